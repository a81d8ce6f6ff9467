"""The evaluation runner behind `kimi-vl eval`: MMLU-Pro, MathVista and their offline proxies for a saved model.

```
kimi-vl eval --model DIR --tasks mmlu_pro,mathvista[,proxies] --out OUT [--data-dir DATA] [--limit N]
```

For every task the runner loads the data first (missing data fails before the model is loaded) and builds all
prompts (a missing image fails before any generation), then generates the pending ones in batches (greedy,
left-padded, progress bar) and appends each finished response to `OUT/responses.<task>.jsonl` (flushed per
batch). A rerun with the same settings reuses every cached response and generates only the rest, so an
interrupted run resumes where it stopped; a response is reused only when its prompt and generation settings are
unchanged (delete the file, or use a fresh `--out`, after changing the model in place). It then scores with the
official protocols (`kimi_vl.eval.mmlu_pro`, `kimi_vl.eval.mathvista`) and writes:

- `results.<task>.json`: per-item records (MMLU-Pro: the rows with `pred` and `model_outputs`; MathVista: the
  official output format keyed by pid, with `response`, `extraction`, `prediction`, `true_false`),
- `scores.mathvista.json` (and `scores.mathvista_synth.json`): the official MathVista scores structure,
- `report.json`, `report.md`, `<task>_categories.png` (see `kimi_vl.eval.report`).

Tasks: `mmlu_pro`, `mathvista`, `mmlu_pro_synth`, `mathvista_synth`; `proxies` stands for the last two.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import mathvista as mv
from . import mmlu_pro as mp
from .generation import Engine, GenerationRequest, first_line
from .proxies import MATHVISTA_SYNTH_SIZE, MMLU_PRO_SYNTH_SIZE, PROXY_SEED, mathvista_synth, mmlu_pro_synth
from .report import write_reports

TASKS: tuple[str, ...] = ("mmlu_pro", "mathvista", "mmlu_pro_synth", "mathvista_synth")
ALIASES: dict[str, tuple[str, ...]] = {"proxies": ("mmlu_pro_synth", "mathvista_synth"), "all": TASKS}
DEFAULT_MAX_NEW_TOKENS: dict[str, int] = {
    "mmlu_pro": mp.MAX_NEW_TOKENS, "mathvista": mv.MAX_NEW_TOKENS, "mmlu_pro_synth": 128, "mathvista_synth": 128,
}
"""Official budgets for the benchmarks; short ones for the proxies (their answers are short)."""
EXTRACTOR_MAX_NEW_TOKENS = 32
MATHVISTA_EXTRACTORS = ("heuristic", "rules", "self")

ProgressCallback = Callable[[str, int, int], None]


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    """Task names from `"mmlu_pro,mathvista,proxies"` or a list, aliases expanded, duplicates dropped."""
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t and t.strip()]
    out: list[str] = []
    for name in names:
        for t in ALIASES.get(name, (name,)):
            if t not in TASKS:
                raise ConfigError(f"unknown eval task {t!r}; choose from {', '.join(TASKS)} or 'proxies'.")
            if t not in out:
                out.append(t)
    if not out:
        raise ConfigError("no eval task given; pass e.g. --tasks mmlu_pro,mathvista,proxies.")
    return out


# ------------------------------------------------------------------------------------------------ response cache
class ResponseCache:
    """Append-only JSONL cache `{"id", "key", "response"}` of finished generations; a truncated last line (an
    interrupted write) is ignored."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            with open(self.path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
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
            for item_id, key, response in entries:
                rec = {"id": item_id, "key": key, "response": response}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                self.records[item_id] = rec
            f.flush()
            os.fsync(f.fileno())


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1, default=str) + "\n", encoding="utf-8")


def _key(*parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, ensure_ascii=False, default=str).encode("utf-8")).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------- items
@dataclass
class _Item:
    id: str
    text: str
    chat: bool
    row: dict[str, Any]
    image: Callable[[], Any] | None = None


@dataclass
class _Task:
    name: str
    items: list[_Item]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)


def _unique_ids(rows: Sequence[dict], field_name: str) -> list[str]:
    ids = [str(r.get(field_name, i)) for i, r in enumerate(rows)]
    return ids if len(set(ids)) == len(ids) else [str(i) for i in range(len(rows))]


def _load_data(name: str, opts: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The task's rows (before any model is loaded, so missing data fails fast)."""
    proxy = name.endswith("_synth")
    limit, seed = opts["limit"], opts["proxy_seed"]
    if name.startswith("mmlu_pro"):
        if proxy:
            test, val = mmlu_pro_synth(limit if limit is not None else MMLU_PRO_SYNTH_SIZE, seed)
            return {"rows": mp.ordered_items(test), "val": val, "source": f"synthetic world, seed {seed}"}
        test, val = mp.load_mmlu_pro(opts["data_dir"], validation=opts["num_shots"] > 0)
        source = str(opts["data_dir"]) if opts["data_dir"] else mp.HF_REPO
        return {"rows": mp.ordered_items(test, limit), "val": val, "source": source}
    if proxy:
        problems = mathvista_synth(out_dir / f"{name}_data", limit if limit is not None else MATHVISTA_SYNTH_SIZE, seed)
        return {"problems": problems, "pids": list(problems), "source": f"synthetic world, seed {seed}"}
    problems = mv.load_mathvista(opts["data_dir"])
    source = str(opts["data_dir"]) if opts["data_dir"] else mv.HF_REPO
    return {"problems": problems, "pids": list(mv.iter_ordered(problems, limit)), "source": source}


def _mmlu_task(name: str, data: dict[str, Any], engine: Engine, opts: dict[str, Any]) -> _Task:
    rows, val = data["rows"], data["val"]
    max_new = opts["max_new_tokens"] or DEFAULT_MAX_NEW_TOKENS[name]
    max_len = engine.max_length(opts["max_model_length"])
    chat = opts["mmlu_pro_format"] == "chat"
    items = []
    for item_id, row in zip(_unique_ids(rows, "question_id"), rows):
        prompt, shots = mp.build_prompt_within_budget(
            val, row, engine.count_tokens, k=opts["num_shots"], max_model_length=max_len, max_new_tokens=max_new
        )
        items.append(_Item(item_id, prompt, chat, {**row, "shots": shots}))
    return _Task(name, items, max_new, mp.STOP, {"source": data["source"], "max_model_length": max_len})


def _mathvista_task(name: str, data: dict[str, Any], engine: Engine, opts: dict[str, Any]) -> _Task:
    chat = opts["mathvista_format"] == "chat"
    items = []
    for pid in data["pids"]:
        problem = data["problems"][pid]
        loader = None
        if engine.supports_images:
            mv.resolve_image(problem)  # fail before generating when an image is missing
            loader = lambda p=problem: mv.load_problem_image(p)  # noqa: E731
        items.append(_Item(pid, mv.query_of(problem), chat, problem, loader))
    max_new = opts["max_new_tokens"] or DEFAULT_MAX_NEW_TOKENS[name]
    return _Task(name, items, max_new, (), {"source": data["source"]})


# -------------------------------------------------------------------------------------------------- generation
def _generate_task(
    task: _Task, engine: Engine, out_dir: Path, batch_size: int, progress: bool,
    progress_callback: ProgressCallback | None,
) -> dict[str, str]:
    from tqdm.auto import tqdm

    cache = ResponseCache(out_dir / f"responses.{task.name}.jsonl")
    keys = {it.id: _key(engine.name, it.text, it.chat, task.max_new_tokens, task.stop) for it in task.items}
    responses: dict[str, str] = {}
    pending = []
    for it in task.items:
        cached = cache.get(it.id, keys[it.id])
        if cached is None:
            pending.append(it)
        else:
            responses[it.id] = cached
    pending.sort(key=lambda it: len(it.text), reverse=True)  # similar lengths per batch: less padding
    total = len(task.items)
    with tqdm(total=total, initial=total - len(pending), desc=task.name, disable=not progress, unit="item") as bar:
        for start in range(0, len(pending), batch_size):
            batch = pending[start : start + batch_size]
            requests = [GenerationRequest(it.text, it.chat, it.image() if it.image else None) for it in batch]
            outs = engine.generate(requests, max_new_tokens=task.max_new_tokens, stop=task.stop)
            cache.extend([(it.id, keys[it.id], o) for it, o in zip(batch, outs)])
            responses.update({it.id: o for it, o in zip(batch, outs)})
            bar.update(len(batch))
            if progress_callback is not None:
                progress_callback(task.name, len(responses), total)
    return responses


# ----------------------------------------------------------------------------------------------------- scoring
def _score_mmlu(task: _Task, responses: dict[str, str], out_dir: Path, opts: dict[str, Any]) -> dict[str, Any]:
    records = []
    for it in task.items:
        text = responses[it.id]
        records.append({**it.row, "model_outputs": text, "pred": mp.extract_answer(text, level=3)})
    _write_json(out_dir / f"results.{task.name}.json", records)
    result = mp.score(records)
    shots = Counter(r["shots"] for r in records)
    deviations = [
        "generation with transformers `generate` (greedy) instead of vLLM; the stop string is checked on the "
        "decoded text",
        "overall accuracy is correct/total (the official script adds 1e-6 to the denominator)",
    ]
    if any(k < opts["num_shots"] for k in shots):
        deviations.append(f"some questions got fewer than {opts['num_shots']} shots (prompt over the token budget, "
                          f"as officially, or too few validation rows): questions per shot count "
                          f"{dict(sorted(shots.items()))}")
    if opts["num_shots"] != mp.NUM_SHOTS:
        deviations.append(f"{opts['num_shots']} shots instead of {mp.NUM_SHOTS}")
    if opts["mmlu_pro_format"] == "chat":
        deviations.append("the official raw prompt was sent as one user turn through the chat template")
    if opts["limit"] is not None and not task.name.endswith("_synth"):
        deviations.append(f"--limit {opts['limit']}: a subset (round-robin over categories), not the full test set")
    return {
        "task": task.name,
        "title": "MMLU-Pro",
        "proxy": task.name.endswith("_synth"),
        "accuracy": result["accuracy"],
        "correct": result["correct"],
        "total": result["total"],
        "random_guesses": result["random_guesses"],
        "categories": result["categories"],
        "category_label": "category",
        "settings": {
            "source": task.info["source"], "shots": opts["num_shots"], "format": opts["mmlu_pro_format"],
            "max_new_tokens": task.max_new_tokens, "max_model_length": task.info["max_model_length"],
            "extraction": "official 3-level chain", "decoding": "greedy",
        },
        "deviations": deviations,
    }


def _extractor(spec: str, engine: Engine, opts: dict[str, Any]) -> tuple[Engine | None, str]:
    if spec in ("heuristic", "rules"):
        return None, spec
    if spec == "self":
        return engine, f"self ({engine.name})"
    judge = Engine.from_pretrained(spec, device=opts["device"], dtype=opts["dtype"],
                                   trust_remote_code=opts["trust_remote_code"])
    return judge, f"model {spec}"


def _score_mathvista(
    task: _Task, responses: dict[str, str], engine: Engine, out_dir: Path, opts: dict[str, Any], batch_size: int,
    progress: bool,
) -> dict[str, Any]:
    judge, extractor_desc = _extractor(opts["mathvista_extractor"], engine, opts)
    quick = opts["quick_extract"]
    llm_answers: dict[str, str] = {}
    if judge is not None:
        undecided = [it for it in task.items if mv.rule_extract(responses[it.id], it.row, quick_extract=quick) is None]
        sub = _Task(f"{task.name}.extraction", [
            _Item(it.id, mv.build_extraction_prompt(mv.query_of(it.row), responses[it.id]), True, it.row)
            for it in undecided
        ], EXTRACTOR_MAX_NEW_TOKENS)
        raw = _generate_task(sub, judge, out_dir, batch_size, progress, None)
        llm_answers = {it.text: first_line(raw[it.id]) for it in sub.items}
    outputs: dict[str, dict[str, Any]] = {}
    for it in task.items:
        response = responses[it.id]
        extraction = mv.extract_answer(
            response, it.row, quick_extract=quick, llm=(llm_answers.__getitem__ if judge is not None else None),
            heuristic=opts["mathvista_extractor"] == "heuristic",
        )
        record = {k: v for k, v in it.row.items() if k not in ("decoded_image", "_image_root")}
        record.update({"query": mv.query_of(it.row), "response": response, "extraction": extraction})
        record.update(mv.score_problem(it.row, extraction))
        outputs[it.id] = record
    scores = mv.compute_scores(outputs)
    _write_json(out_dir / f"results.{task.name}.json", outputs)
    _write_json(out_dir / f"scores.{task.name}.json", scores)
    categories = {}
    for key, names in (("task", mv.TASK_ABBREVIATIONS), ("skills", mv.SKILL_ABBREVIATIONS)):
        for value, s in scores.get(key, {}).items():
            label = names.get(value, value)
            categories[label] = {"accuracy": s["correct"] / s["total"], "correct": s["correct"], "total": s["total"]}
    deviations = []
    if opts["mathvista_extractor"] == "heuristic":
        deviations.append("answers the official rules leave undecided are extracted by a rule-based heuristic "
                          "(kimi_vl.eval.mathvista.heuristic_extract), not by the official GPT extractor")
    elif opts["mathvista_extractor"] == "rules":
        deviations.append("no LLM extractor: answers the official rules leave undecided count as empty extractions")
    else:
        deviations.append(f"the official GPT extractor is replaced by {extractor_desc} with the official demo prompt "
                          f"(greedy, at most {EXTRACTOR_MAX_NEW_TOKENS} new tokens, first line of its answer)")
    if not engine.supports_images:
        deviations.append("the model has no image input: it was given the query text only")
    if opts["mathvista_format"] == "raw" or not engine.has_chat_template:
        deviations.append("the query was given as a raw prompt (no chat template)")
    if opts["limit"] is not None and not task.name.endswith("_synth"):
        deviations.append(f"--limit {opts['limit']}: the first {opts['limit']} testmini problems only")
    correct, total = scores["average"]["correct"], scores["average"]["total"]
    return {
        "task": task.name,
        "title": "MathVista testmini",
        "proxy": task.name.endswith("_synth"),
        "accuracy": correct / total if total else 0.0,
        "correct": correct,
        "total": total,
        "leaderboard": mv.leaderboard(scores),
        "scores": scores,
        "categories": categories,
        "category_label": "task / skill",
        "settings": {
            "source": task.info["source"], "extractor": extractor_desc, "quick_extract": quick,
            "format": opts["mathvista_format"], "max_new_tokens": task.max_new_tokens, "decoding": "greedy",
            "images": engine.supports_images,
        },
        "deviations": deviations,
    }


# ------------------------------------------------------------------------------------------------------- API
def evaluate(
    model_dir: str | os.PathLike | Engine,
    tasks: str | Sequence[str],
    out_dir: str | os.PathLike,
    *,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    num_shots: int = mp.NUM_SHOTS,
    max_model_length: int = mp.MAX_MODEL_LENGTH,
    mmlu_pro_format: str = "official",
    mathvista_format: str = "chat",
    mathvista_extractor: str = "heuristic",
    quick_extract: bool = True,
    proxy_seed: int = PROXY_SEED,
    progress: bool = True,
    progress_callback: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Evaluate a saved model (or a ready `Engine`) on `tasks`, write the reports under `out_dir`, return the
    report (`{"model": ..., "tasks": {task: entry}, "files": {...}}`).

    Args:
        tasks: `"mmlu_pro,mathvista,proxies"` or a list of task names.
        data_dir: local benchmark files (see `kimi_vl.eval.data`); None downloads them from the hub.
        limit: at most this many items per task (MMLU-Pro: round-robin over categories; MathVista: the first ones;
            proxies: that many generated items).
        batch_size: prompts per generation batch.
        max_new_tokens: generation budget for every task; default per task (`DEFAULT_MAX_NEW_TOKENS`).
        num_shots, max_model_length: MMLU-Pro shots (5; 0 needs no validation split) and the context length of the
            shot budget (4096, or the model's `max_position_embeddings` when smaller).
        mmlu_pro_format: `"official"` (raw completion prompt) or `"chat"` (the same prompt as one user turn).
        mathvista_format: `"chat"` (query + image as a user turn through the chat template) or `"raw"`.
        mathvista_extractor: `"heuristic"` (official rules, then `heuristic_extract`), `"rules"` (official rules
            only), `"self"` (the evaluated model as the LLM extractor) or a model directory (that model).
        quick_extract: the official `--quick_extract` rule.
        proxy_seed: seed of the synthetic proxies.
        progress_callback: called as `(task, done, total)` after every batch (an exception it raises stops the run;
            finished batches stay cached).

    Raises:
        ConfigError: bad options. DataUnavailableError: data missing / hub unreachable. CheckpointError: bad model.
    """
    names = parse_tasks(tasks)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if num_shots < 0:
        raise ConfigError(f"num_shots must be >= 0, got {num_shots}.")
    if mmlu_pro_format not in ("official", "chat"):
        raise ConfigError(f"mmlu_pro_format must be 'official' or 'chat', got {mmlu_pro_format!r}.")
    if mathvista_format not in ("chat", "raw"):
        raise ConfigError(f"mathvista_format must be 'chat' or 'raw', got {mathvista_format!r}.")
    if mathvista_extractor not in MATHVISTA_EXTRACTORS and not (Path(mathvista_extractor) / "config.json").is_file():
        raise ConfigError(
            f"mathvista_extractor must be one of {', '.join(MATHVISTA_EXTRACTORS)} or a saved model directory; "
            f"{mathvista_extractor!r} is neither."
        )
    opts = {
        "data_dir": data_dir, "limit": limit, "max_new_tokens": max_new_tokens, "device": device, "dtype": dtype,
        "trust_remote_code": trust_remote_code, "num_shots": num_shots, "max_model_length": max_model_length,
        "mmlu_pro_format": mmlu_pro_format, "mathvista_format": mathvista_format,
        "mathvista_extractor": mathvista_extractor, "quick_extract": quick_extract, "proxy_seed": proxy_seed,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {n: _load_data(n, opts, out) for n in names}
    engine = model_dir if isinstance(model_dir, Engine) else Engine.from_pretrained(
        model_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code
    )
    built = [
        (_mmlu_task if n.startswith("mmlu_pro") else _mathvista_task)(n, data[n], engine, opts) for n in names
    ]
    report: dict[str, Any] = {"model": engine.info(), "tasks": {}}
    for task in built:
        responses = _generate_task(task, engine, out, batch_size, progress, progress_callback)
        if task.name.startswith("mmlu_pro"):
            report["tasks"][task.name] = _score_mmlu(task, responses, out, opts)
        else:
            report["tasks"][task.name] = _score_mathvista(task, responses, engine, out, opts, batch_size, progress)
    files = write_reports(report, out)
    report["files"] = {k: str(v) for k, v in files.items()}
    return report


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `kimi-vl eval` options to `parser`."""
    parser.add_argument("--model", required=True, help="saved model directory (Kimi-VL or any transformers "
                        "causal / image-text-to-text model with its tokenizer or processor)")
    parser.add_argument("--tasks", default="mmlu_pro,mathvista",
                        help=f"comma-separated: {', '.join(TASKS)}, or 'proxies' (default: mmlu_pro,mathvista)")
    parser.add_argument("--out", required=True, help="output directory (reports, per-item results, response cache)")
    parser.add_argument("--data-dir", default=None, help="local benchmark files (DIR/mmlu_pro/test*.parquet|jsonl, "
                        "DIR/mmlu_pro/validation*..., DIR/mathvista/testmini.json + images/); default: the hub")
    parser.add_argument("--limit", type=int, default=None, help="at most N items per task")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="generation budget (default: 2048 MMLU-Pro, 1024 MathVista, 128 proxies)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--trust-remote-code", action="store_true", help="allow remote-code models")
    parser.add_argument("--num-shots", type=int, default=mp.NUM_SHOTS, help="MMLU-Pro shots (default 5; 0 needs no "
                        "validation split)")
    parser.add_argument("--max-model-length", type=int, default=mp.MAX_MODEL_LENGTH,
                        help="MMLU-Pro context length for the shot budget (default 4096)")
    parser.add_argument("--mmlu-pro-format", default="official", choices=["official", "chat"],
                        help="official raw prompt, or the same prompt as a chat user turn")
    parser.add_argument("--mathvista-format", default="chat", choices=["chat", "raw"])
    parser.add_argument("--mathvista-extractor", default="heuristic",
                        help="heuristic | rules | self | MODEL_DIR: what extracts answers the official rules leave "
                             "undecided (the official one is GPT; see the report's deviations)")
    parser.add_argument("--no-quick-extract", dest="quick_extract", action="store_false",
                        help="skip the official quick-extract rule")
    parser.add_argument("--proxy-seed", type=int, default=PROXY_SEED, help="seed of the synthetic proxies")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run_eval_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run `evaluate` from parsed `add_eval_arguments` options; prints a summary and returns the report."""
    report = evaluate(
        args.model, args.tasks, args.out, data_dir=args.data_dir, limit=args.limit, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, device=args.device, dtype=args.dtype,
        trust_remote_code=args.trust_remote_code, num_shots=args.num_shots, max_model_length=args.max_model_length,
        mmlu_pro_format=args.mmlu_pro_format, mathvista_format=args.mathvista_format,
        mathvista_extractor=args.mathvista_extractor, quick_extract=args.quick_extract, proxy_seed=args.proxy_seed,
        progress=args.progress,
    )
    from .report import task_title

    for entry in report["tasks"].values():
        print(f"{task_title(entry)}: {100 * entry['accuracy']:.2f}% ({entry['correct']}/{entry['total']})")
    print(f"wrote {report['files']['md']}")
    return report


__all__ = [
    "ALIASES",
    "DEFAULT_MAX_NEW_TOKENS",
    "ResponseCache",
    "TASKS",
    "add_eval_arguments",
    "evaluate",
    "parse_tasks",
    "run_eval_from_args",
]
