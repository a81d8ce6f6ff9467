"""The evaluation runner behind `kimi-vl eval`: registered benchmarks (MMLU-Pro, MathVista, their offline proxies,
and any benchmark added with `kimi_vl.eval.registry.register`) for a saved model.

```
kimi-vl eval --model DIR --benchmarks mmlu_pro,mathvista[,proxies] --out OUT [--data-dir DATA] [--limit N]
```

For every benchmark the runner loads the data first (missing data fails before the model is loaded) and builds all
prompts (a missing image fails before any generation), then generates the pending ones in batches (greedy,
left-padded, progress bar) and appends each finished response to `OUT/responses.<benchmark>.jsonl` (flushed per
batch). A rerun with the same settings reuses every cached response and generates only the rest, so an
interrupted run resumes where it stopped; a response is reused only when the model (its `*.safetensors` files'
`weights_fingerprint`, whatever the folder is called: a model trained again in place is generated anew; an
in-memory model or one without safetensors files: its name), its dtype, its prompt and the generation settings are
unchanged. It then extracts the answers and scores them with the benchmark's protocol (see `kimi_vl.eval.benchmarks`
for the files each writes) and writes `report.json`, `report.md`, `<benchmark>_categories.png` (see
`kimi_vl.eval.report`). The output folder is cumulative: the report covers this run's benchmarks and those of the
folder's earlier report when that came from the same model and dtype; an earlier report of another model (or other
weights, or dtype) is replaced, with a warning naming it and the benchmarks left out.

Benchmarks: `mmlu_pro`, `mathvista`, `mmlu_pro_synth`, `mathvista_synth`; the aliases `proxies` (every proxy) and
`all` (every registered benchmark). Options: `kimi_vl.eval.config.EvalConfig`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..progress import progress_bar
from . import benchmarks as _builtin  # noqa: F401 - registers the built-in benchmarks
from .config import EvalConfig, add_config_options, config_from_args
from .generation import Engine, GenerationRequest, resolve_device
from .registry import ALIASES, BENCHMARKS, Item, Prompts, parse_benchmarks
from .report import benchmark_title, make_output_dir, write_reports

ProgressCallback = Callable[[str, int, int], None]


# ------------------------------------------------------------------------------------------------ response cache
class ResponseCache:
    """Append-only JSONL cache `{"id", "key", "response"}` of finished generations; a truncated last line (an
    interrupted write) is ignored, and the next entries start on a line of their own."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self._mid_line = False  # the file ends inside a line (an interrupted write)
        if self.path.is_file():
            with open(self.path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    self._mid_line = not line.endswith("\n")
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        self.records[str(rec["id"])] = rec
                    except (ValueError, KeyError, TypeError):
                        warnings.warn(f"{self.path}:{n}: unreadable cache line skipped (an interrupted write?)",
                                      stacklevel=2)

    def get(self, item_id: str, key: str) -> str | None:
        rec = self.records.get(item_id)
        return rec["response"] if rec is not None and rec.get("key") == key else None

    def extend(self, entries: Sequence[tuple[str, str, str]]) -> None:
        """Append `(id, key, response)` entries and flush them to disk."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            if self._mid_line:
                f.write("\n")
                self._mid_line = False
            for item_id, key, response in entries:
                rec = {"id": item_id, "key": key, "response": response}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                self.records[item_id] = rec
            f.flush()
            os.fsync(f.fileno())


def _model_id(info: dict[str, Any]) -> tuple[Any, Any]:
    """What cached responses and report entries come from, from an `Engine.info()`: the model's weights (its name
    when they are unknown) and its dtype."""
    return info.get("weights") or info.get("name"), info.get("dtype")


def _key(*parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, ensure_ascii=False, default=str).encode("utf-8")).hexdigest()[:16]


def _image_digest(item: Item) -> str | None:
    """A digest of the item's image pixels (None without an image): a cached response is reused only for the same
    image, so the same question about another image (another proxy seed, an updated data file) is generated anew."""
    if item.image is None:
        return None
    image = item.image()
    return hashlib.sha1(repr((image.mode, image.size)).encode() + image.tobytes()).hexdigest()


# -------------------------------------------------------------------------------------------------- generation
@dataclass
class EvalRun:
    """One `evaluate` call as the benchmarks see it: the evaluated engine, the options and the output folder."""

    engine: Engine
    config: EvalConfig
    out_dir: Path

    def generate(self, name: str, prompts: Prompts, *, engine: Engine | None = None,
                 progress_callback: ProgressCallback | None = None) -> dict[str, str]:
        """`{item id: response}` of `prompts` generated by `engine` (default: the evaluated one) in batches of
        `config.batch_size`, cached in `out_dir/responses.<name>.jsonl` (cached responses are reused when the
        engine's weights (`_model_id`) and dtype, the prompt, image and generation settings are the same);
        `progress_callback(name, done, total)` after every batch."""
        engine = engine or self.engine
        cache = ResponseCache(self.out_dir / f"responses.{name}.jsonl")
        model = _model_id(engine.info())
        keys = {it.id: _key(*model, it.text, it.chat, prompts.max_new_tokens, prompts.stop, _image_digest(it))
                for it in prompts.items}
        responses: dict[str, str] = {}
        pending = []
        for it in prompts.items:
            cached = cache.get(it.id, keys[it.id])
            if cached is None:
                pending.append(it)
            else:
                responses[it.id] = cached
        pending.sort(key=lambda it: len(it.text), reverse=True)  # similar lengths per batch: less padding
        total, size = len(prompts.items), self.config.batch_size
        with progress_bar(total=total, initial=total - len(pending), desc=name, enabled=self.config.progress,
                          unit="item") as bar:
            for start in range(0, len(pending), size):
                batch = pending[start : start + size]
                requests = [GenerationRequest(it.text, it.chat, it.image() if it.image else None) for it in batch]
                outs = engine.generate(requests, max_new_tokens=prompts.max_new_tokens, stop=prompts.stop)
                cache.extend([(it.id, keys[it.id], o) for it, o in zip(batch, outs)])
                responses.update({it.id: o for it, o in zip(batch, outs)})
                bar.update(len(batch))
                if progress_callback is not None:
                    progress_callback(name, len(responses), total)
        return responses


# ------------------------------------------------------------------------------------------------------ report
def _earlier_entries(out: Path, model: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The benchmark entries of `out/report.json` that the new report keeps beside this run's (`names`): all of them
    when they come from `model` (`_model_id`: the same weights and dtype), else none, with a warning naming the
    earlier model and the benchmarks left out."""
    path = out / "report.json"
    if not path.is_file():
        return {}
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
        was, entries = earlier["model"], dict(earlier["benchmarks"])
    except (ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{path} is unreadable ({exc}); this run's report replaces it", stacklevel=3)
        return {}
    if _model_id(was) == _model_id(model):
        return entries
    left_out = [name for name in entries if name not in names]
    warnings.warn(f"{path} comes from another model, other weights or another dtype ({was.get('name')}, "
                  f"{was.get('dtype')}): its cached responses are generated anew"
                  + (f" and {', '.join(left_out)} left out of the report" if left_out else ""), stacklevel=3)
    return {}


# ------------------------------------------------------------------------------------------------------- API
def evaluate(
    model_dir: str | os.PathLike | Engine,
    benchmarks: str | Sequence[str],
    out_dir: str | os.PathLike,
    config: EvalConfig | None = None,
    *,
    progress_callback: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Evaluate a saved model (or a ready `Engine`) on `benchmarks`, write the reports under `out_dir`, return the
    report (`{"model": ..., "benchmarks": {name: entry}, "files": {...}}`). The report also keeps the other
    benchmarks of `out_dir`'s earlier report when it comes from the same model and dtype (see the module docstring).

    Args:
        benchmarks: `"mmlu_pro,mathvista,proxies"` or a list of registered benchmark names and aliases.
        config: the options (`EvalConfig`; default: the official settings).
        progress_callback: called as `(benchmark, done, total)` after every batch (an exception it raises stops the
            run; finished batches stay cached).

    Raises:
        ConfigError: bad options (a device this machine lacks, `out_dir` a file). DataUnavailableError: data missing /
            hub unreachable / empty. DataError: a malformed benchmark row. CheckpointError: bad model.
    """
    selected = parse_benchmarks(benchmarks)
    config = config or EvalConfig()
    if config.device is not None:
        resolve_device(config.device)  # before the data is read and the output folder made
    out = make_output_dir(out_dir)
    data = {b.name: b.load(config, out) for b in selected}
    engine = model_dir if isinstance(model_dir, Engine) else Engine.from_pretrained(
        model_dir, device=config.device, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
        progress=config.progress,
    )
    run = EvalRun(engine, config, out)
    prompts = {b.name: b.build_prompts(data[b.name], engine, config) for b in selected}
    report: dict[str, Any] = {"model": engine.info()}
    report["benchmarks"] = _earlier_entries(out, report["model"], [b.name for b in selected])
    for b in selected:
        responses = run.generate(b.name, prompts[b.name], progress_callback=progress_callback)
        answers = b.extract(prompts[b.name], responses, run)
        entry = b.score(prompts[b.name], responses, answers, run)
        report["benchmarks"][b.name] = {"benchmark": b.name, "title": b.title, "proxy": b.proxy, **entry,
                                        **b.baselines(data[b.name])}
    files = write_reports(report, out)
    report["files"] = {k: str(v) for k, v in files.items()}
    return report


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `kimi-vl eval` options to `parser`: `--model`, `--benchmarks`, `--out`, and one per `EvalConfig`
    field."""
    parser.add_argument("--model", required=True, help="saved model directory (Kimi-VL or any transformers "
                        "causal / image-text-to-text model with its tokenizer or processor)")
    parser.add_argument("--benchmarks", default="mmlu_pro,mathvista",
                        help=f"comma-separated: {', '.join(BENCHMARKS)}, or the aliases {', '.join(ALIASES)} "
                             "(default: mmlu_pro,mathvista)")
    parser.add_argument("--out", required=True, help="output directory (reports, per-item results, response cache)")
    add_config_options(parser.add_argument_group("evaluation options"))


def run_eval_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run `evaluate` from parsed `add_eval_arguments` options; prints a summary and returns the report."""
    report = evaluate(args.model, args.benchmarks, args.out, config_from_args(args))
    for entry in report["benchmarks"].values():
        print(f"{benchmark_title(entry)}: {100 * entry['accuracy']:.2f}% ({entry['correct']}/{entry['total']}); "
              f"chance {100 * entry['chance']:.1f}%, constant answer {100 * entry['constant']:.1f}%")
    print(f"wrote {report['files']['md']}")
    return report


__all__ = ["EvalRun", "ResponseCache", "add_eval_arguments", "evaluate", "run_eval_from_args"]
