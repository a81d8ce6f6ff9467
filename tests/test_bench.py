"""The benchmark scripts' shared helpers (bench/common.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import run_isolated  # noqa: E402


def _reports(value, queue):
    queue.put({"value": value})


def _dies(queue):
    raise SystemExit(3)


def test_run_isolated_returns_the_workers_report():
    assert run_isolated(_reports, 7) == {"value": 7}


def test_run_isolated_raises_when_the_worker_dies_before_reporting():
    """A worker that exits without putting (an exception, the out-of-memory killer) stops the benchmark instead of
    leaving it waiting on the queue forever."""
    with pytest.raises(RuntimeError, match="exited with status 3"):
        run_isolated(_dies)
