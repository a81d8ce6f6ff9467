"""Progress reports: a live tqdm bar on a terminal or in a notebook, whole lines in a log.

tqdm redraws its bar with carriage returns (and, nested, cursor moves), which a terminal shows as one line and a
log file keeps as every redraw: a redirected quickstart (`kimi-vl quickstart > run.log 2>&1`, a cluster job) wrote
1.5 MB of them. Where stderr is neither a terminal nor a notebook, `progress_bar` returns `LogLines` instead: the
same interface, one plain line at most every `interval` seconds, when the description changes, and at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm.auto import tqdm

LOG_INTERVAL = 30.0
"""Seconds between two lines of a `LogLines` report."""


def interactive(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default: stderr) shows a live bar: a terminal, or the output of a Jupyter kernel."""
    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        return True
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class LogLines:
    """tqdm's interface as whole lines: `desc: n/total (p%), rate, elapsed, left | postfix`.

    A line is written when `interval` seconds have passed since the last one, when the count reaches `total`, when
    the description changes (at once if the count moved since the last line: a loop that names its next item after
    counting the last one writes one line, not two; else with the next count: a loop that names its next item
    before counting the last one writes the new name beside the new count), and on `close` if the count moved since
    the last line."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, initial: int = 0,
                 desc: str = "", unit: str = "it", interval: float = LOG_INTERVAL, file: TextIO | None = None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n, self.desc, self.unit, self.interval = total, initial, desc, unit, interval
        self.file = file
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.initial = initial
        self.last_n: int | None = None  # the count the last line showed
        self.last_desc = desc  # and its description
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if (now - self.last >= self.interval or (self.total is not None and self.n >= self.total)
                or self.desc != self.last_desc):
            self._write(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_description(self, desc: str) -> None:
        if desc != self.desc:
            self.desc = desc
            if self.last_n != self.n:
                self._write(time.monotonic())

    def close(self) -> None:
        if not self.closed and self.n != self.last_n and self.n != self.initial:
            self._write(time.monotonic())
        self.closed = True

    def line(self, now: float) -> str:
        """The report at monotonic time `now`."""
        elapsed = now - self.start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 and done else None
        count = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {count}" if self.desc else count]
        if rate is not None:
            per_second = f"{rate:.3g}" if rate < 1000 else f"{rate:,.0f}"
            parts.append(f"{per_second} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}")
        parts.append(f"{tqdm.format_interval(elapsed)} elapsed")
        if rate is not None and self.total:
            parts.append(f"{tqdm.format_interval(max(self.total - self.n, 0) / rate)} left")
        return ", ".join(parts) + (f" | {self.postfix}" if self.postfix else "")

    def _write(self, now: float) -> None:
        print(self.line(now), file=self.file or sys.stderr, flush=True)
        self.last, self.last_n, self.last_desc = now, self.n, self.desc


def progress_bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                 enabled: bool = True, initial: int = 0, unit: str = "it") -> tqdm | LogLines:
    """A progress report over `iterable` (or `total` steps from `initial`): a tqdm bar where stderr is interactive
    (`interactive`), `LogLines` elsewhere, and a disabled tqdm bar (silent, same interface) when not `enabled`."""
    if enabled and not interactive():
        return LogLines(iterable, total=total, initial=initial, desc=desc, unit=unit)
    return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=not enabled,
                dynamic_ncols=True)


@contextmanager
def transformers_bars(enabled: bool) -> Iterator[None]:
    """transformers' own bars (loading and writing weights) inside the block where ours would show a live bar:
    off when not `enabled` or where stderr is not interactive (a log keeps every tqdm redraw), as they were after."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    if was_on and not (enabled and interactive()):
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()
