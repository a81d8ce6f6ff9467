"""Building batches ahead of the training step in data-loader processes.

`batches(stream, indices, num_workers)` yields `stream.batch(i)` for each index in order. With `num_workers > 0`,
forked `torch.utils.data.DataLoader` workers build them ahead (each batch is a pure function of its index, so the
workers need no shared state and resuming needs no loader state); a `KimiVLError` raised while building a batch is
re-raised in the training process as it was (the same type and message).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import ConfigError, DataLoaderWorkerError, KimiVLError


class _Failure:
    """A batch that could not be built: its exception travels back to the training process."""

    def __init__(self, error: KimiVLError) -> None:
        self.error = error


class _Batches(torch.utils.data.Dataset):
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __getitem__(self, index: int) -> Any:
        try:
            return self.stream.batch(index)
        except KimiVLError as exc:
            return _Failure(exc)


def _first(items: Any) -> Any:
    return items


STOP_GRACE_S = 5.0
"""Seconds a worker that got SIGTERM waits to learn whether the training process got it too."""

_stopping: Any = None  # a multiprocessing Event, made before the first workers fork (they inherit it)


def set_stopping(flag: bool) -> None:
    """Tell this process's data-loader workers that it is stopping after its step (`kimi_vl.training.stop` sets this
    when a stop signal comes and clears it when the loop ends)."""
    if _stopping is not None:
        _stopping.set() if flag else _stopping.clear()


def _on_sigterm(signum: int, frame: Any) -> None:
    # A scheduler's time limit (or `timeout`) sends SIGTERM to every process of the job: when the training process
    # got it too, it finishes its step, which needs this worker's batches, and shuts the workers down itself. Any
    # other SIGTERM (the loader's own fallback, a kill of this worker) ends it as before.
    if _stopping is not None and _stopping.wait(STOP_GRACE_S):
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_init(_: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the Rust tokenizers' own threads and fork do not mix
    torch.set_num_threads(1)
    # a terminal's Ctrl-C reaches every process of its group: the training process decides whether to stop
    # (`kimi_vl.training.stop`) and shuts its workers down itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)


def worker_error(exc: BaseException) -> DataLoaderWorkerError | None:
    """`exc` as a `DataLoaderWorkerError` when it is torch's report of a worker that ended (raised in the training
    process at its next batch, or anywhere by the loader's SIGCHLD handler), else None."""
    if not (isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker")):
        return None
    return DataLoaderWorkerError(
        f"{str(exc).strip()}: a data-loader process ended before the run did (killed, or by the system for want of "
        "memory). Rerun the same command to resume from the last checkpoint; with --num-workers 0 the batches are "
        "built in the training process.")


def batches(stream: Any, indices: Sequence[int], num_workers: int = 0, prefetch: int = 2) -> Iterator[Any]:
    """`stream.batch(i)` for `i` in `indices`, in order, built by `num_workers` forked processes (0: here)."""
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}.")
    if num_workers == 0:
        for i in indices:
            yield stream.batch(i)
        return
    if "fork" not in multiprocessing.get_all_start_methods():
        raise ConfigError("data-loader workers need the fork start method, which this platform lacks; set "
                          "num_workers=0.")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    global _stopping
    if _stopping is None:
        _stopping = multiprocessing.get_context("fork").Event()
    loader = torch.utils.data.DataLoader(
        _Batches(stream), batch_size=None, sampler=list(indices), num_workers=num_workers, collate_fn=_first,
        prefetch_factor=prefetch, worker_init_fn=_worker_init, multiprocessing_context="fork")
    for item in loader:
        if isinstance(item, _Failure):
            raise item.error
        yield item


__all__ = ["batches", "set_stopping", "worker_error"]
