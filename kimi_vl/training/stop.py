"""Stopping a training run cleanly on Ctrl-C or a scheduler's SIGTERM.

Killed mid-step, a run loses every step since its last checkpoint (up to `checkpoint_every`; for the `small` preset
1000 steps). While `StopOnSignal` is active, the first SIGINT or SIGTERM only asks the loop to stop: it finishes the
step it is in, writes a checkpoint at the next step where one can be written (RL: a rollout batch's end) and raises
`TrainingInterrupted`; rerunning the same command resumes there exactly. A second SIGINT interrupts at once
(`KeyboardInterrupt`), as without it. In a distributed run every rank asks after every step whether any rank got a
signal, so that all stop after the same step. Data-loader workers (`kimi_vl.data.loader`) ignore SIGINT, which a
terminal's Ctrl-C sends to every process of its group, and outlive a SIGTERM that the training process got too (a
scheduler's time limit reaches every process of the job), since the step in progress still needs their batches; the
training process shuts them down itself.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

import torch

from ..data.loader import set_stopping
from .distributed import all_reduce_max, get_world_size

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    """A context manager: while active, SIGINT / SIGTERM set `received` (the signal's name) instead of killing the
    process. Handlers are installed only from the main thread (Python delivers signals there) and only over the
    default ones, so a caller's own handlers stay in charge; the previous handlers come back on exit."""

    def __init__(self, announce: bool = True) -> None:
        self.received: str | None = None
        self.signum = 0
        self.announce = announce
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                current = signal.getsignal(sig)
                if current in (signal.default_int_handler, signal.SIG_DFL):
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        set_stopping(False)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received, self.signum = signal.Signals(signum).name, signum
        set_stopping(True)
        if self.announce:
            again = (" (press Ctrl-C again to stop at once, losing the steps since the last checkpoint)"
                     if signum == signal.SIGINT else "")
            print(f"\n{self.received}: stopping after this step with a checkpoint{again}", file=sys.stderr, flush=True)


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """`flag` of this process or, in a distributed run, of any rank (a collective: every rank asks after every step,
    so that all stop after the same one). `device`: where the process group's tensors live (CUDA for NCCL)."""
    if get_world_size() == 1:
        return flag
    return bool(all_reduce_max(torch.tensor([int(flag)], device=device)).item())
