"""What a benchmark is, and the registry of the benchmarks `evaluate` knows by name.

A benchmark is one `Benchmark` object with four steps, which the runner (`kimi_vl.eval.runner.evaluate`) calls
in this order:

1. `load(config, work_dir) -> BenchmarkData`: its rows (from the hub, local files under `config.data_dir` or the
   synthetic world), for every selected benchmark before any model is loaded, so missing data fails fast;
2. `build_prompts(data, engine, config) -> Prompts`: one prompt per row (text, chat or raw, an image loader), the
   generation budget and stop strings, for every selected benchmark before any generation, so a missing image
   fails early;
3. `extract(prompts, responses, run) -> {item id: answer}`: the answer in each generated response;
4. `score(prompts, responses, answers, run) -> entry`: the report entry (`accuracy`, `correct`, `total`,
   `categories`, `category_label`, `settings`, `deviations`, ...; see `kimi_vl.eval.report`), writing the
   per-item results under `run.out_dir`.

Every entry also states the accuracy a model would get without reading the questions (`baselines(data)`):
`chance` (uniform guessing: 1 / options on multiple choice, 0 on free form) and `constant` (the best single constant
answer: the most frequent correct letter, and on free form the most frequent answer), with `constant_answer`
saying what that answer is. A score means something only well above `constant`.

The runner generates between steps 2 and 3 (batched, cached, resumable; `run.generate` is there for benchmarks
that generate again, e.g. with an LLM answer extractor) and puts `benchmark`, `title` and `proxy` first in each
entry. `register(obj)` adds a benchmark; `parse_benchmarks` selects them by name or alias (`ALIASES`).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError

if TYPE_CHECKING:
    from .config import EvalConfig
    from .generation import Engine
    from .runner import EvalRun


@dataclass
class BenchmarkData:
    """A benchmark's rows as loaded.

    Attributes:
        rows: `{item id: row}` in evaluation order (ids unique, used for the response cache and results).
        source: where the rows came from, for reports (a hub dataset, a folder, "synthetic world, seed N").
        examples: rows prompts may draw worked examples from (MMLU-Pro: the validation split).
    """

    rows: dict[str, dict[str, Any]]
    source: str
    examples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Item:
    """One prompt: `text` as a raw prompt or (`chat`) as one user turn, the row it was built from and, for image
    questions, a loader of its image (called when its batch is generated)."""

    id: str
    text: str
    chat: bool
    row: dict[str, Any]
    image: Callable[[], Any] | None = None


@dataclass
class Prompts:
    """A benchmark's prompts, generated greedily with at most `max_new_tokens` new tokens each, cut at the first
    `stop` string; `info` holds what the benchmark wants to report from building them (e.g. the data source)."""

    items: list[Item]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)


class Benchmark(abc.ABC):
    """A benchmark: `load`, `build_prompts`, `extract`, `score` (see the module docstring).

    Class attributes: `name` (how it is selected: lower-case letters, digits and `_`), `title` (reports; proxies
    get "(synthetic proxy)" appended), `proxy` (built from the synthetic world, not the benchmark itself),
    `max_new_tokens` (its generation budget unless `EvalConfig.max_new_tokens` is set).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    proxy: ClassVar[bool] = False
    max_new_tokens: ClassVar[int]

    def budget(self, config: EvalConfig) -> int:
        """New tokens per response under `config`."""
        return config.max_new_tokens or self.max_new_tokens

    @abc.abstractmethod
    def load(self, config: EvalConfig, work_dir: Path) -> BenchmarkData:
        """The rows to evaluate (`config.limit` applied); `work_dir` is the output folder, for generated files."""

    @abc.abstractmethod
    def build_prompts(self, data: BenchmarkData, engine: Engine, config: EvalConfig) -> Prompts:
        """One `Item` per row of `data`, for `engine`."""

    @abc.abstractmethod
    def extract(self, prompts: Prompts, responses: dict[str, str], run: EvalRun) -> dict[str, Any]:
        """`{item id: answer}` from `{item id: response}`."""

    @abc.abstractmethod
    def score(self, prompts: Prompts, responses: dict[str, str], answers: dict[str, Any],
              run: EvalRun) -> dict[str, Any]:
        """The report entry; writes the per-item results under `run.out_dir`."""

    @abc.abstractmethod
    def baselines(self, data: BenchmarkData) -> dict[str, Any]:
        """`{"chance", "constant", "constant_answer"}` of the rows (see the module docstring)."""


BENCHMARKS: dict[str, Benchmark] = {}
"""The registered benchmarks by name, in registration order."""
ALIASES: dict[str, Callable[[], list[str]]] = {
    "proxies": lambda: [name for name, b in BENCHMARKS.items() if b.proxy],
    "all": lambda: list(BENCHMARKS),
}
"""Names that stand for several benchmarks: every registered proxy, every registered benchmark."""
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register(benchmark: Benchmark) -> Benchmark:
    """Add `benchmark` to the registry under its `name`; returns it.

    Raises:
        ConfigError: not a `Benchmark`, a malformed name, or a name already taken (by a benchmark or an alias).
    """
    if not isinstance(benchmark, Benchmark):
        raise ConfigError(f"register takes a Benchmark instance, got {benchmark!r}.")
    name = getattr(benchmark, "name", "")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"benchmark name {name!r} must be lower-case letters, digits and '_', starting with a "
                          "letter.")
    if name in BENCHMARKS or name in ALIASES:
        raise ConfigError(f"a benchmark or alias named {name!r} is already registered; pick another name "
                          "(or `unregister` it first).")
    BENCHMARKS[name] = benchmark
    return benchmark


def unregister(name: str) -> Benchmark:
    """Remove the benchmark `name` from the registry; returns it."""
    if name not in BENCHMARKS:
        raise ConfigError(f"no benchmark named {name!r} is registered.")
    return BENCHMARKS.pop(name)


def parse_benchmarks(benchmarks: str | Sequence[str]) -> list[Benchmark]:
    """The benchmarks of `"mmlu_pro,mathvista,proxies"` or a list of names, aliases expanded, duplicates dropped.

    Raises:
        ConfigError: an unknown name, or none given.
    """
    names = [n.strip() for n in (benchmarks.split(",") if isinstance(benchmarks, str) else benchmarks)
             if n and n.strip()]
    out: dict[str, Benchmark] = {}
    for name in names:
        for n in ALIASES[name]() if name in ALIASES else [name]:
            if n not in BENCHMARKS:
                raise ConfigError(f"unknown benchmark {n!r}; choose from {', '.join(BENCHMARKS)} or the aliases "
                                  f"{', '.join(ALIASES)}.")
            out.setdefault(n, BENCHMARKS[n])
    if not out:
        raise ConfigError("no benchmark given; pass e.g. --benchmarks mmlu_pro,mathvista,proxies.")
    return list(out.values())


__all__ = [
    "ALIASES", "BENCHMARKS", "Benchmark", "BenchmarkData", "Item", "Prompts", "parse_benchmarks", "register",
    "unregister",
]
