"""The built-in benchmarks, registered on import: `mmlu_pro`, `mathvista` (official protocols, `kimi_vl.eval.mmlu_pro`
and `kimi_vl.eval.mathvista`) and their offline proxies `mmlu_pro_synth`, `mathvista_synth` (`kimi_vl.eval.proxies`),
which load their rows from the synthetic world and are otherwise evaluated exactly like the benchmark.

Each writes `results.<name>.json` under the output folder (MMLU-Pro: the rows with `pred` and `model_outputs`;
MathVista: the official output format keyed by pid, with `response`, `extraction`, `prediction`, `true_false`);
MathVista also writes the official scores structure to `scores.<name>.json`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import mathvista as mv
from . import mmlu_pro as mp
from .generation import Engine, first_line
from .proxies import MATHVISTA_SYNTH_SIZE, MMLU_PRO_SYNTH_SIZE, lookup_misses, mathvista_synth, mmlu_pro_synth
from .registry import Benchmark, BenchmarkData, Item, Prompts, register

if TYPE_CHECKING:
    from .config import EvalConfig
    from .runner import EvalRun

PROXY_MAX_NEW_TOKENS = 128
"""Generation budget of the proxies (their answers are short)."""
EXTRACTOR_MAX_NEW_TOKENS = 32


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1, default=str) + "\n", encoding="utf-8")


def _unique_ids(rows: Sequence[dict], field_name: str) -> list[str]:
    ids = [str(r.get(field_name, i)) for i, r in enumerate(rows)]
    return ids if len(set(ids)) == len(ids) else [str(i) for i in range(len(rows))]


def _source(config: EvalConfig, hub_repo: str) -> str:
    return str(config.data_dir) if config.data_dir else hub_repo


# ------------------------------------------------------------------------------------------------------ MMLU-Pro
class MMLUPro(Benchmark):
    """MMLU-Pro: the official k-shot chain-of-thought prompt within the token budget, the official 3-level
    extraction chain and its seeded random guess, overall and per-category accuracy."""

    name = "mmlu_pro"
    title = "MMLU-Pro"
    max_new_tokens = mp.MAX_NEW_TOKENS

    def _data(self, test: list[dict], val: list[dict], source: str) -> BenchmarkData:
        return BenchmarkData(dict(zip(_unique_ids(test, "question_id"), test)), source, val)

    def load(self, config: EvalConfig, work_dir: Path) -> BenchmarkData:
        test, val = mp.load_mmlu_pro(config.data_dir, validation=config.num_shots > 0)
        return self._data(mp.ordered_items(test, config.limit), val, _source(config, mp.HF_REPO))

    def build_prompts(self, data: BenchmarkData, engine: Engine, config: EvalConfig) -> Prompts:
        max_new = self.budget(config)
        max_len = engine.max_length(config.max_model_length)
        chat = config.mmlu_pro_format == "chat"
        items = []
        for item_id, row in data.rows.items():
            prompt, shots = mp.build_prompt_within_budget(
                data.examples, row, engine.count_tokens, k=config.num_shots, max_model_length=max_len,
                max_new_tokens=max_new,
            )
            items.append(Item(item_id, prompt, chat, {**row, "shots": shots}))
        return Prompts(items, max_new, mp.STOP, {"source": data.source, "max_model_length": max_len})

    def extract(self, prompts: Prompts, responses: dict[str, str], run: EvalRun) -> dict[str, Any]:
        return {it.id: mp.extract_answer(responses[it.id], level=3) for it in prompts.items}

    def baselines(self, data: BenchmarkData) -> dict[str, Any]:
        return mp.baselines(list(data.rows.values()))

    def diagnostics(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Entries the report adds beside the official scores, from the scored `records` (none for MMLU-Pro)."""
        return {}

    def score(self, prompts: Prompts, responses: dict[str, str], answers: dict[str, Any],
              run: EvalRun) -> dict[str, Any]:
        config = run.config
        chat = config.mmlu_pro_format == "chat" and run.engine.has_chat_template  # without a template: the raw prompt
        prompt_format = config.mmlu_pro_format if chat or config.mmlu_pro_format == "official" else (
            "official (chat asked, but the model has no chat template)")
        records = [{**it.row, "model_outputs": responses[it.id], "pred": answers[it.id]} for it in prompts.items]
        write_json(run.out_dir / f"results.{self.name}.json", records)
        result = mp.score(records)
        for category, entry in result["categories"].items():  # each category beside its own baselines
            entry.update(mp.baselines([r for r in records if r["category"] == category]))
        shots = Counter(r["shots"] for r in records)
        deviations = [
            "generation with transformers `generate` (greedy) instead of vLLM; the stop string is checked on the "
            "decoded text",
            "overall accuracy is correct/total (the official script adds 1e-6 to the denominator)",
        ]
        if any(k < config.num_shots for k in shots):
            deviations.append(f"some questions got fewer than {config.num_shots} shots (prompt over the token "
                              f"budget, as officially, or too few validation rows): questions per shot count "
                              f"{dict(sorted(shots.items()))}")
        if config.num_shots != mp.NUM_SHOTS:
            deviations.append(f"{config.num_shots} shots instead of {mp.NUM_SHOTS}")
        if chat:
            deviations.append("the official raw prompt was sent as one user turn through the chat template")
        if config.limit is not None and not self.proxy:
            deviations.append(f"--limit {config.limit}: a subset (round-robin over categories), not the full test "
                              "set")
        return {
            "accuracy": result["accuracy"],
            "correct": result["correct"],
            "total": result["total"],
            "random_guesses": result["random_guesses"],
            "categories": result["categories"],
            "category_label": "category",
            "settings": {
                "source": prompts.info["source"], "shots": config.num_shots, "format": prompt_format,
                "max_new_tokens": prompts.max_new_tokens, "max_model_length": prompts.info["max_model_length"],
                "extraction": "official 3-level chain", "decoding": "greedy",
            },
            "deviations": deviations,
            **self.diagnostics(records),
        }


class MMLUProSynth(MMLUPro):
    """The MMLU-Pro proxy: multiple-choice questions of the synthetic world in the MMLU-Pro schema (worked examples
    from the next seed), evaluated exactly like MMLU-Pro."""

    name = "mmlu_pro_synth"
    proxy = True
    max_new_tokens = PROXY_MAX_NEW_TOKENS

    def load(self, config: EvalConfig, work_dir: Path) -> BenchmarkData:
        test, val = mmlu_pro_synth(MMLU_PRO_SYNTH_SIZE if config.limit is None else config.limit, config.proxy_seed,
                                   config.proxy_split)
        return self._data(mp.ordered_items(test), val,
                          f"synthetic world, {config.proxy_split} split, seed {config.proxy_seed}")

    def diagnostics(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """`lookup_misses`: replies with the right value and a wrong letter."""
        return {"lookup_misses": lookup_misses(records)}


# ----------------------------------------------------------------------------------------------------- MathVista
def _extractor_description(spec: str, engine: Engine) -> str:
    if spec in ("heuristic", "rules"):
        return spec
    return f"self ({engine.name})" if spec == "self" else f"model {spec}"


class MathVista(Benchmark):
    """MathVista testmini: the official query (with the image when the model takes images), the official
    extraction rules then `EvalConfig.mathvista_extractor`, the official normalisation and scores."""

    name = "mathvista"
    title = "MathVista testmini"
    max_new_tokens = mv.MAX_NEW_TOKENS

    def load(self, config: EvalConfig, work_dir: Path) -> BenchmarkData:
        problems = mv.load_mathvista(config.data_dir)
        pids = mv.iter_ordered(problems, config.limit)
        return BenchmarkData({pid: problems[pid] for pid in pids}, _source(config, mv.HF_REPO))

    def build_prompts(self, data: BenchmarkData, engine: Engine, config: EvalConfig) -> Prompts:
        chat = config.mathvista_format == "chat"
        items = []
        for pid, problem in data.rows.items():
            loader = None
            if engine.supports_images:
                mv.resolve_image(problem)  # fail before generating when an image is missing
                loader = lambda p=problem: mv.load_problem_image(p)  # noqa: E731
            items.append(Item(pid, mv.query_of(problem), chat, problem, loader))
        return Prompts(items, self.budget(config), (), {"source": data.source})

    def baselines(self, data: BenchmarkData) -> dict[str, Any]:
        return mv.baselines(data.rows)

    def extract(self, prompts: Prompts, responses: dict[str, str], run: EvalRun) -> dict[str, Any]:
        """The official rules, then the configured extractor; an LLM extractor (`self` or a model directory) is
        asked, through the response cache, about the responses the rules leave undecided."""
        spec, quick = run.config.mathvista_extractor, run.config.quick_extract
        llm = None
        if spec not in ("heuristic", "rules"):
            judge = run.engine if spec == "self" else Engine.from_pretrained(
                spec, device=run.config.device, dtype=run.config.dtype,
                trust_remote_code=run.config.trust_remote_code, progress=run.config.progress,
            )
            undecided = [it for it in prompts.items
                         if mv.rule_extract(responses[it.id], it.row, quick_extract=quick) is None]
            sub = Prompts([Item(it.id, mv.build_extraction_prompt(mv.query_of(it.row), responses[it.id]), True, it.row)
                           for it in undecided], EXTRACTOR_MAX_NEW_TOKENS)
            raw = run.generate(f"{self.name}.extraction", sub, engine=judge)
            llm = {it.text: first_line(raw[it.id]) for it in sub.items}.__getitem__
        return {
            it.id: mv.extract_answer(responses[it.id], it.row, quick_extract=quick, llm=llm,
                                     heuristic=spec == "heuristic")
            for it in prompts.items
        }

    def score(self, prompts: Prompts, responses: dict[str, str], answers: dict[str, Any],
              run: EvalRun) -> dict[str, Any]:
        config, engine = run.config, run.engine
        outputs: dict[str, dict[str, Any]] = {}
        for it in prompts.items:
            record = {k: v for k, v in it.row.items() if k not in ("decoded_image", "_image_root")}
            record.update({"query": mv.query_of(it.row), "response": responses[it.id], "extraction": answers[it.id]})
            record.update(mv.score_problem(it.row, answers[it.id]))
            outputs[it.id] = record
        scores = mv.compute_scores(outputs)
        write_json(run.out_dir / f"results.{self.name}.json", outputs)
        write_json(run.out_dir / f"scores.{self.name}.json", scores)
        breakdowns = (("category", {}), ("task", mv.TASK_ABBREVIATIONS), ("skills", mv.SKILL_ABBREVIATIONS))
        parts: dict[tuple[str, Any], dict[str, Any]] = {}  # MathVista's parts, each scored beside its own baselines
        for it in prompts.items:
            flat = mv.flatten_metadata(it.row)
            for key, _ in breakdowns:
                for value in mv.breakdown_values(flat, key):
                    parts.setdefault((key, value), {})[it.id] = it.row
        categories = {}
        for key, names in breakdowns:
            for value, s in scores.get(key, {}).items():
                categories[names.get(value, value)] = {"accuracy": s["correct"] / s["total"], "correct": s["correct"],
                                                       "total": s["total"], **mv.baselines(parts[key, value])}
        extractor = _extractor_description(config.mathvista_extractor, engine)
        deviations = []
        if config.mathvista_extractor == "heuristic":
            deviations.append("answers the official rules leave undecided are extracted by a rule-based heuristic "
                              "(kimi_vl.eval.mathvista.heuristic_extract), not by the official GPT extractor")
        elif config.mathvista_extractor == "rules":
            deviations.append("no LLM extractor: answers the official rules leave undecided count as empty "
                              "extractions")
        else:
            deviations.append(f"the official GPT extractor is replaced by {extractor} with the official demo "
                              f"prompt (greedy, at most {EXTRACTOR_MAX_NEW_TOKENS} new tokens, first line of its "
                              "answer)")
        if config.quick_extract:
            deviations.append('the official --quick_extract rule (The answer is "...".) is on, as an option the '
                              "official script offers (its default: off)")
        if not engine.supports_images:
            deviations.append("the model has no image input: it was given the query text only")
        if config.mathvista_format == "raw" or not engine.has_chat_template:
            deviations.append("the query was given as a raw prompt (no chat template)")
        if config.limit is not None and not self.proxy:
            deviations.append(f"--limit {config.limit}: the first {config.limit} testmini problems only")
        correct, total = scores["average"]["correct"], scores["average"]["total"]
        return {
            "accuracy": correct / total if total else 0.0,
            "correct": correct,
            "total": total,
            "leaderboard": mv.leaderboard(scores),
            "scores": scores,
            "categories": categories,
            "category_label": "category / task / skill",
            "settings": {
                "source": prompts.info["source"], "extractor": extractor, "quick_extract": config.quick_extract,
                "format": config.mathvista_format, "max_new_tokens": prompts.max_new_tokens, "decoding": "greedy",
                "images": engine.supports_images,
            },
            "deviations": deviations,
        }


class MathVistaSynth(MathVista):
    """The MathVista proxy: image problems of the synthetic world in the testmini schema (images written under the
    output folder), evaluated exactly like MathVista."""

    name = "mathvista_synth"
    proxy = True
    max_new_tokens = PROXY_MAX_NEW_TOKENS

    def load(self, config: EvalConfig, work_dir: Path) -> BenchmarkData:
        n = MATHVISTA_SYNTH_SIZE if config.limit is None else config.limit
        return BenchmarkData(mathvista_synth(work_dir / f"{self.name}_data", n, config.proxy_seed, config.proxy_split),
                             f"synthetic world, {config.proxy_split} split, seed {config.proxy_seed}")


for _benchmark in (MMLUPro(), MathVista(), MMLUProSynth(), MathVistaSynth()):
    register(_benchmark)

__all__ = ["EXTRACTOR_MAX_NEW_TOKENS", "MMLUPro", "MMLUProSynth", "MathVista", "MathVistaSynth",
           "PROXY_MAX_NEW_TOKENS", "write_json"]
