"""The benchmark scripts' shared helpers (bench/common.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import peak_rss_mib, run_isolated  # noqa: E402


def _reports(value, queue):
    queue.put({"value": value})


def _reports_peak(queue):
    queue.put({"peak_mib": peak_rss_mib()})


def _dies(queue):
    raise SystemExit(3)


def test_run_isolated_returns_the_workers_report():
    assert run_isolated(_reports, 7) == {"value": 7}


def test_run_isolated_raises_when_the_worker_dies_before_reporting():
    """A worker that exits without putting (an exception, the out-of-memory killer) stops the benchmark instead of
    leaving it waiting on the queue forever."""
    with pytest.raises(RuntimeError, match="exited with status 3"):
        run_isolated(_dies)


def test_peak_rss_of_a_worker_is_its_own_not_its_parents():
    """A worker's peak resident memory is its own even when its parent's peak is far larger (`ru_maxrss` starts
    at the parent's peak in a spawned process, so the memory benchmarks' workers undercounted their growth)."""
    ballast = bytearray(384 * 2**20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touch every page: the parent's peak grows
    del ballast
    assert peak_rss_mib() > 384
    assert run_isolated(_reports_peak)["peak_mib"] < 256
