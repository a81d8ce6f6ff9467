"""`kimi-vl quickstart`: the whole pipeline on the embedded default data, offline, resumable.

Stages, each in its own directory under `out` and skipped when already finished (rerunning after an interruption
continues from the last finished stage, and inside a training stage from its last checkpoint):

1. `vit/`       ViT training: the vision tower alone on labelled images (counts, shapes' and pages' colours)
   `pretrain/`  tokenizer + joint text-vision pre-training from that tower (AttnRes, MuonClip, vision from step one)
2. `sft/`       zero-vision SFT (text-only chats)
3. `rl/`        joint text-vision RL (K2.5 objective, verifiable rewards)
4. `eval/`      MMLU-Pro and MathVista (real data with `data_dir`, else the synthetic proxies, labelled) for the
                pre-trained, SFT and RL models
5. `demo/`      video-to-website on a held-out generated screencast (rendered and scored when Chromium is there)
6. `model/`     the final Hugging Face checkpoint, and `REPORT.md` with tables and plots
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

from .demos.similarity import gap_closed
from .errors import ConfigError
from .eval.proxies import MATHVISTA_SYNTH_SIZE, MMLU_PRO_SYNTH_SIZE
from .export import export_remote_code
from .model_card import model_card
from .progress import progress_bar
from .training.presets import get_preset
from .training.stages import pretrain, read_summary, rl, sft, vit
from .training.vit import VIT_TARGETS

STAGES = ("vit", "pretrain", "sft", "rl", "eval", "demo", "report")
TRAINING_STAGES = ("vit", "pretrain", "sft", "rl")
"""The stages whose steps `scale` multiplies."""
DEMO_SEED = 1_000_000
"""Seed of the demo's screencast, a page of the world's held-out eval split."""


def _done(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _scaled(n: int, scale: float) -> int:
    return max(2, round(n * scale))


EVAL_STAGES = {"pretrain": "after pre-training", "sft": "after SFT", "rl": "after RL"}
"""The checkpoints `run_eval` evaluates, with their REPORT.md column headings."""


FRESH_SEED_OFFSET = 1
"""The fresh draw of the proxies (the final model's score on other held-out items) uses the next seed."""
KEEP = ("accuracy", "correct", "total", "proxy", "chance", "constant", "constant_answer", "categories", "lookup_misses")
MATHVISTA_PARTS = ("general-vqa", "math-targeted-vqa")
"""MathVista's two categories: counting objects in scenes; values read off charts and geometry diagrams."""
MMLU_PRO_SYNTH_PARTS = ("other", "engineering", "math")
"""The MMLU-Pro proxy's categories: the world's facts, unit conversions, two-digit arithmetic."""


def run_eval(out: Path, data_dir: str | Path | None, limit: int | None, progress: bool) -> dict[str, Any]:
    """Evaluate the pre-trained, SFT and RL checkpoints (the same prompts for all three: the pre-trained model has
    seen chats only with images, so its text scores show what SFT adds), and on the proxies also the RL checkpoint
    on a fresh draw (another seed: the skill, not the items); proxies use `PROXY_EVAL_CONFIG`, real benchmarks
    their official settings."""
    import dataclasses

    from .eval.config import EvalConfig
    from .eval.proxies import PROXY_EVAL_CONFIG
    from .eval.runner import evaluate

    marker = out / "eval" / "done.json"
    arguments = {"data_dir": None if data_dir is None else str(data_dir), "limit": limit}
    if (done := _done(marker)) is not None and done.get("arguments", arguments) == arguments:
        return done  # a rerun with other evaluation arguments evaluates again (cached replies are reused)
    if data_dir is None:
        benchmarks, options = ["mmlu_pro_synth", "mathvista_synth"], PROXY_EVAL_CONFIG
    else:
        benchmarks, options = ["mmlu_pro", "mathvista"], EvalConfig()
    config = dataclasses.replace(options, data_dir=data_dir, limit=limit, progress=progress)
    runs = {name: (out / name, config) for name in EVAL_STAGES}
    if data_dir is None:
        runs["fresh"] = (out / "rl", dataclasses.replace(config, proxy_seed=config.proxy_seed + FRESH_SEED_OFFSET))
    results = {}
    for name, (model_dir, cfg) in runs.items():
        report = evaluate(model_dir, benchmarks, out / "eval" / name, cfg)
        results[name] = {b: {k: v for k, v in e.items() if k in KEEP} for b, e in report["benchmarks"].items()}
    results["settings"], results["arguments"] = options.changes(), arguments
    marker.write_text(json.dumps(results, indent=1))
    return results


def run_demo(out: Path, model_dir: Path) -> dict[str, Any]:
    """video2web on a held-out screencast; scored against the frames when Chromium is available, beside a blank white
    page (the floor), fixed pages of the right kind (the constant answer: `fixed_page_scores`) and the true page on the
    same frames."""
    import random

    import numpy as np

    from .data.screencast import screencast_font, write_video
    from .data.world import make_sample
    from .demos.render import BrowserNotFoundError, find_chromium
    from .demos.video2web import (
        blank_page_score,
        fixed_page_scores,
        page_fields_read,
        render_and_score,
        run_video2web,
    )

    marker = out / "demo" / "done.json"
    if (done := _done(marker)) is not None:
        return done
    demo = out / "demo"
    demo.mkdir(parents=True, exist_ok=True)
    cast = make_sample("screencast", random.Random(DEMO_SEED), split="eval").video  # a held-out page
    video = write_video(cast.frames, demo / "screencast.mp4", cast.fps)
    (demo / "target.html").write_text(cast.html)
    try:
        find_chromium()
        render = True
    except BrowserNotFoundError:
        render = False
    frames = np.stack([np.asarray(f) for f in cast.frames])  # the page and its baselines scored on the same frames
    result = run_video2web(video, model_dir, demo, render=render, max_new_tokens=256, score_frames=frames)
    blank = blank_page_score(frames)
    true = render_and_score(demo / "target.html", frames, demo / "true")[3]["score"] if render else None
    fixed = fixed_page_scores(frames, demo / "fixed") if render else None
    summary = {"video": str(video), "site": str(result.site), "stop": result.stop, "new_tokens": result.new_tokens,
               "font": screencast_font(), "rendered": render, "score": (result.score or {}).get("score"),
               "blank_page_score": blank, "true_page_score": true, "fixed_page_scores": fixed,
               "fields_read": page_fields_read(result.html, cast.spec),
               "compare": str(result.compare) if result.compare else None}
    marker.write_text(json.dumps(summary, indent=1))
    return summary


def export_final(out: Path, source: Path, seed: int) -> Path:
    """The final checkpoint, self-contained (remote code and `auto_map`), without its training records (resume
    states, metrics, plots: `export_remote_code`), as `out/model`, with a model card that adds the evaluation."""
    preset = (read_summary(source) or {}).get("preset")
    card = model_card(source, name=f"kimi-vl quickstart ({preset} preset, seed {seed})",
                      evaluation=card_evaluation(_done(out / "eval" / "done.json") or {}))
    return export_remote_code(source, out / "model", overwrite=True, card=card)


def card_evaluation(ev: dict[str, Any]) -> str:
    """The model card's evaluation: each benchmark after RL (and on the fresh draw) beside chance and the
    constant answer; empty without an evaluation."""
    if "rl" not in ev:
        return ""
    proxy = any(e.get("proxy") for e in ev["rl"].values())
    fresh = "fresh" in ev
    lines = ["## Evaluation" + (" (synthetic proxies of the benchmarks, held out from training)" if proxy else ""),
             "", "| benchmark | score | " + ("fresh draw | " if fresh else "") + "chance | constant answer |",
             "|---|---|" + ("---|" if fresh else "") + "---|---|"]
    for name, entry in ev["rl"].items():
        again = f"{_cell(ev['fresh'][name])} | " if fresh and name in ev["fresh"] else "- | " if fresh else ""
        lines.append(f"| {name} | {_cell(entry)} | {again}{_baseline(entry, 'chance')} | "
                     f"{_baseline(entry, 'constant')} |")
    return "\n".join(lines + ["", "Greedy generation with each benchmark's own answer extraction and scoring; the "
                              "constant answer is one answer given to every item: the letter most often right, and "
                              "on free form the most frequent answer."])


def check_arguments(preset: str, scale: float, eval_limit: int | None, data_dir: str | Path | None) -> int:
    """Fail before any training on what would only fail (or mean nothing) after it: `scale` must be a positive
    number, `eval_limit` at least 1, and `data_dir` must hold both benchmarks' files (the evaluation reads them after
    the training stages). Raises `ConfigError`, `DataUnavailableError` or `DataError` (a malformed row). (A GPU
    preset without a CUDA device warns when the first stage resolves its configuration: `warn_without_cuda`.)
    Returns the number of items the evaluation of one checkpoint scores (both benchmarks, `eval_limit` applied)."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ConfigError(f"scale must be a positive number (e.g. 0.05 for a smoke run, 1 for the full run); got "
                          f"{scale!r}.")
    if eval_limit is not None and eval_limit < 1:
        raise ConfigError(f"eval_limit must be at least 1 item per benchmark (or left out: all); got {eval_limit}.")
    if data_dir is not None:
        from .eval.config import EvalConfig
        from .eval.mathvista import load_mathvista
        from .eval.mmlu_pro import load_mmlu_pro

        sizes = [len(load_mmlu_pro(data_dir, validation=EvalConfig().num_shots > 0)[0]), len(load_mathvista(data_dir))]
    else:
        sizes = [MMLU_PRO_SYNTH_SIZE, MATHVISTA_SYNTH_SIZE]
    return sum(n if eval_limit is None else min(n, eval_limit) for n in sizes)


def quickstart(out: str | Path = "runs/quickstart", *, preset: str = "tiny", data_dir: str | Path | None = None,
               scale: float = 1.0, eval_limit: int | None = None, seed: int = 0, progress: bool = True) -> Path:
    """Run (or resume) every stage; returns the path of `REPORT.md`. `scale` multiplies every stage's step count
    (e.g. 0.05 for a smoke run); `eval_limit` caps the items per benchmark. The arguments are checked before any
    stage runs (`check_arguments`)."""
    p = get_preset(preset)
    eval_items = check_arguments(preset, scale, eval_limit, data_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    times = _done(out / "stage_times.json") or {}
    shares = stage_shares(scale, eval_items)
    # Percent of the run's expected time; each line names the stage now running, after the count of those done.
    bar = progress_bar(total=100, initial=sum(shares[s] for s in times if s in shares), desc="quickstart",
                       enabled=progress, unit="%")
    bar.set_description(f"quickstart [{next((s for s in STAGES if s not in times), STAGES[-1])}]")
    for stage, following in zip(STAGES, [*STAGES[1:], "done"]):
        t0 = time.perf_counter()
        if stage == "vit":
            vit(out / "vit", preset=preset, steps=_scaled(p.stages["vit"].steps, scale), seed=seed, progress=progress)
        elif stage == "pretrain":
            pretrain(out / "pretrain", preset=preset, steps=_scaled(p.stages["pretrain"].steps, scale), seed=seed,
                     progress=progress, vision_tower=str(out / "vit"))
        elif stage == "sft":
            sft(out / "pretrain", out / "sft", steps=_scaled(p.stages["sft"].steps, scale), seed=seed,
                progress=progress)
        elif stage == "rl":
            rl(out / "sft", out / "rl", families=["text", "vision"], steps=_scaled(p.stages["rl"].steps, scale),
               seed=seed, progress=progress)
        elif stage == "eval":
            run_eval(out, data_dir, eval_limit, progress)
        elif stage == "demo":
            run_demo(out, out / "rl")
        else:
            export_final(out, out / "rl", seed)
            write_report(out, times)
            for line in letter_lookup_warnings(_done(out / "eval" / "done.json") or {}):
                warnings.warn(line, UserWarning, stacklevel=2)
        bar.set_description(f"quickstart [{following}]")
        if stage not in times:
            times[stage] = time.perf_counter() - t0
            bar.update(shares[stage])
        (out / "stage_times.json").write_text(json.dumps(times, indent=1))
    bar.close()
    return out / "REPORT.md"


STAGE_SECONDS = {"vit": 141.0, "pretrain": 877.0, "sft": 93.0, "rl": 26.0, "eval": 29.0, "demo": 7.0, "report": 0.1}
"""Each stage's wall time in seconds in a default run (seed 0 of `runs/qs19` on the 2-core AMD EPYC Zen 5 of
docs/RESULTS.md, 19.6 min), the weights of the run's progress line: counted as equal stages (six then), the line
told a user that 72 minutes were left when pre-training ended after 14, with 2.5 to go. Measured with the `tiny`
preset; another preset's run is weighted alike (pre-training most of it there too), so its time left is a rougher
guide."""


def stage_shares(scale: float, eval_items: int) -> dict[str, int]:
    """Each stage's expected share of the run in whole percent, each within a point of the exact share and summing
    to 100: `STAGE_SECONDS` with the training stages scaled by `scale` and the evaluation by the items it scores
    (`eval_items` per checkpoint; the default run's proxies score 240)."""
    seconds = {stage: s * (scale if stage in TRAINING_STAGES else 1.0) for stage, s in STAGE_SECONDS.items()}
    seconds["eval"] *= eval_items / (MMLU_PRO_SYNTH_SIZE + MATHVISTA_SYNTH_SIZE)
    total = sum(seconds.values())
    exact = {stage: 100 * s / total for stage, s in seconds.items()}
    shares = {stage: math.floor(x) for stage, x in exact.items()}
    for stage in sorted(exact, key=lambda st: shares[st] - exact[st])[:100 - sum(shares.values())]:
        shares[stage] += 1  # the largest remainders round up
    return shares


def headline(out: Path) -> list[str]:
    """The run's result in a few lines, for the end of the command: where the model is, each benchmark after RL
    beside chance and the constant answer, the demo's share of the blank-to-true gap, the wall time."""
    ev, demo = _done(out / "eval" / "done.json") or {}, _done(out / "demo" / "done.json") or {}
    times = _done(out / "stage_times.json") or {}
    lines = [f"model: {out / 'model'} (with its card, README.md); report: {out / 'REPORT.md'}"]
    for name, e in ev.get("rl", {}).items():
        lines.append(f"{name} after RL: {100 * e['accuracy']:.1f}% (chance {100 * e['chance']:.1f}%, constant answer "
                     f"{100 * e['constant']:.1f}%)")
    if demo.get("rendered"):
        gap = gap_closed(demo["score"], demo["blank_page_score"], demo["true_page_score"])
        lines.append(f"video to website: the page closes {100 * gap:.0f}% of the gap from a blank page to the true one")
    if times:
        lines.append(f"wall time: {sum(times.values()) / 60:.1f} min")
    return lines


LOOKUP_MARGIN = 0.10
"""An MMLU-Pro proxy score after RL less than this above its constant answer means the option-letter lookup was
not learned (runs that learned it score 69-85%; one that did not, 12.9% against a 14.3% constant answer)."""
LOOKUP_MISS_SHARE = 0.05
"""A larger share of MMLU-Pro proxy replies after RL that name the right value and then a wrong letter means the
lookup was only partly learned (0-1 of 140 on every quickstart seed of the current drill but one, `runs/qs15`'s
seed 3: 11, its teacher-forced letter skill 85%; docs/RESULTS.md)."""


def letter_lookup_warnings(ev: dict[str, Any]) -> list[str]:
    """A warning for each MMLU-Pro proxy on which the RL model missed the option-letter lookup: scored within
    `LOOKUP_MARGIN` of its constant answer (not learned), or else named the right value and a wrong letter on at
    least `LOOKUP_MISS_SHARE` of the items (partly learned); empty when none."""
    warnings = []
    for name, e in ev.get("rl", {}).items():
        if not (name.startswith("mmlu_pro") and e.get("proxy")):
            continue
        if e["accuracy"] < e["constant"] + LOOKUP_MARGIN:
            warnings.append(
                f"After RL, {name} is {100 * e['accuracy']:.1f}%, within {100 * LOOKUP_MARGIN:.0f} points of its "
                f"constant answer ({100 * e['constant']:.1f}%): this run's pre-training most likely did not learn "
                "to find an option's letter, which happened on 1 of 24 probed pre-training runs of the full "
                "schedule (docs/RESULTS.md); rerun with another `--seed`. A run shortened with `--scale` is not "
                "expected to learn it.")
        elif e.get("lookup_misses", 0) >= LOOKUP_MISS_SHARE * e["total"]:
            warnings.append(
                f"After RL, {e['lookup_misses']} of {e['total']} {name} replies name the right value and then a "
                f"wrong letter: this run learned to find an option's letter only in part ({name} "
                f"{100 * e['accuracy']:.1f}%; runs that learned it miss 0-1 items); another `--seed` may do better.")
    return warnings


def _cell(entry: dict[str, Any]) -> str:
    return f"{100 * entry['accuracy']:.1f}% ({entry['correct']}/{entry['total']})"


def _baseline(entry: dict[str, Any], key: str) -> str:
    """A part's chance or constant answer (with what the constant answer is), "-" where the report predates them."""
    if key not in entry:
        return "-"
    return f"{100 * entry[key]:.1f}%" + (f" ({entry['constant_answer']})" if key == "constant" else "")


def _parts_table(ev: dict[str, Any], name: str, parts: tuple[str, ...], stages: list[str], heads: dict[str, str],
                 caption: str) -> list[str]:
    """Markdown lines: benchmark `name`'s `parts` (categories, those its RL entry has) at every stage, each beside
    its own chance and constant answer."""
    parts = tuple(p for p in parts if p in ev["rl"][name].get("categories", {}))
    if not parts:
        return []
    lines = ["", f"{name} {caption}, each beside its own chance and constant answer:", "",
             "| part | chance | constant answer | " + " | ".join(heads[n] for n in stages) + " |",
             "|---|---|---|" + "---|" * len(stages)]
    for part in parts:
        base = ev["rl"][name]["categories"][part]
        lines.append(f"| {part} | {_baseline(base, 'chance')} | {_baseline(base, 'constant')} | "
                     + " | ".join(_cell(ev[n][name]["categories"][part]) if part in ev[n][name]["categories"]
                                  else "-" for n in stages) + " |")
    return lines


def evaluation_section(ev: dict[str, Any]) -> list[str]:
    """REPORT.md's evaluation: each benchmark against chance and the constant answer at every stage, the fresh
    draw, the MMLU-Pro proxy's categories (facts, conversions, arithmetic) and its option-letter lookup misses,
    MathVista's two parts (counting; values read off charts and diagrams), and the transfer of zero-vision SFT to
    vision."""
    proxy = any(e.get("proxy") for e in ev.get("sft", {}).values())
    stages = [n for n in (*EVAL_STAGES, "fresh") if n in ev]
    heads = {**EVAL_STAGES, "fresh": "after RL, fresh draw"}
    lines = ["## Evaluation" + (" (synthetic proxies, not the real benchmarks)" if proxy else ""), "",
             "| benchmark | chance | constant answer | " + " | ".join(heads[n] for n in stages) + " |",
             "|---|---|---|" + "---|" * len(stages)]
    for name, entry in ev["sft"].items():
        lines.append(f"| {name} | {100 * entry['chance']:.1f}% | {100 * entry['constant']:.1f}% "
                     f"({entry['constant_answer']}) | " + " | ".join(_cell(ev[n][name]) for n in stages) + " |")
    lines += [f"\n**Warning.** {line}" for line in letter_lookup_warnings(ev)]
    text = next((n for n in ev["sft"] if n.startswith("mmlu_pro")), None)
    if text is not None and ev["sft"][text].get("proxy"):
        lines += _parts_table(ev, text, MMLU_PRO_SYNTH_PARTS, stages, heads, "by category (other = the world's facts, "
                              "engineering = unit conversions, math = two-digit arithmetic)")
        misses = [f"{heads[n]} {ev[n][text]['lookup_misses']}" for n in stages if "lookup_misses" in ev[n][text]]
        if misses:
            lines += ["", f"{text} replies that name the right value and then a wrong letter (the option-letter "
                      f"lookup's misses), of {ev['rl'][text]['total']}: " + ", ".join(misses) + "."]
    vision = next((n for n in ev["sft"] if n.startswith("mathvista")), None)
    if vision is not None:
        lines += _parts_table(ev, vision, MATHVISTA_PARTS, stages, heads, "by part (category: general-vqa = counting, "
                              "math-targeted-vqa = values read off charts and diagrams)")
        if "pretrain" in ev:
            before, after = ev["pretrain"][vision]["accuracy"], ev["sft"][vision]["accuracy"]
            lines += ["", f"Zero-vision SFT (no image in any SFT sample) moves {vision} from {100 * before:.1f}% to "
                      f"{100 * after:.1f}% ({100 * (after - before):+.1f} points)."]
        rl = ev["rl"][vision]
        lines.append(f"After RL, {vision} is {100 * (rl['accuracy'] - rl['constant']):+.1f} points from its "
                     f"constant answer.")
    lines += ["", "Accuracy is the benchmark's own generative protocol: greedy generation, the official answer "
              "extraction (MathVista: its rules, then a rule-based stand-in for its GPT extractor) and scoring "
              "(MMLU-Pro: a response without an extractable letter gets the official random guess). Chance is the "
              "expected accuracy of uniform guessing; the constant answer is one answer given to every question, the "
              "letter most often right and on free form the most frequent answer (a score is above chance only when "
              "it is above this)." + (
                  " The proxies' items are held out from every training draw by construction (the world's eval "
                  "split); the fresh draw is another seed of them." if proxy else ""),
              f"Settings: {ev.get('settings')}. Per-item responses and per-category reports are under "
              + ", ".join(f"`eval/{n}/`" for n in stages) + ".", ""]
    return lines


def _family_rewards(rl_summary: dict[str, Any]) -> str:
    """", by task family: text 0.380 -> 0.400, vision 0.230 -> 0.250" from an RL summary (first fifth of the steps
    -> last fifth; empty when the summary has no family rewards: users' prompt rows)."""
    first, last = rl_summary.get("family_reward_first_fifth") or {}, rl_summary.get("family_reward_last_fifth") or {}
    parts = [f"{f} {first[f]:.3f} -> {last[f]:.3f}" for f in first if first[f] is not None and last.get(f) is not None]
    return ", by task family: " + ", ".join(parts) if parts else ""


def vit_lines(summary: dict[str, Any], seconds: float) -> list[str]:
    """The ViT stage in REPORT.md: what it read, and each target's accuracy on held-out images beside chance (none
    for runs without the stage)."""
    if not summary:
        return []
    chance = {f"{task}.{t.name}": t.chance for task, targets in VIT_TARGETS.items() for t in targets}
    accuracy = summary.get("val_accuracy") or {}
    parts = [f"{name} {100 * acc:.1f}%" + (f" (chance {100 * chance[name]:.0f}%)" if chance.get(name) else "")
             for name, acc in accuracy.items()]
    weights = summary.get("tasks") or {}
    tasks = " and ".join(weights) if len(weights) < 2 else ", ".join(f"{t} {w:g}" for t, w in weights.items())
    steps = summary.get("steps") or 1
    return [f"ViT training (the vision tower alone, before joint pre-training): {steps} steps of "
            f"{summary.get('images', 0) // steps} images ({tasks}{' by weight' if len(weights) > 1 else ''}), final "
            f"loss {summary.get('final_loss', 0):.3f}, "
            f"{seconds:.0f} s; accuracy on {summary.get('val_images_per_task')} held-out images per task: "
            f"{', '.join(parts)}.", ""]


def _img(path: Path, out: Path, alt: str) -> str:
    return f"![{alt}]({path.relative_to(out)})" if path.is_file() else f"({alt}: not produced)"


def write_report(out: Path, times: dict[str, float]) -> Path:
    """`REPORT.md`: stage summaries, evaluation scores against chance, RL rewards, the demo, and the plots."""
    s = {name: read_summary(out / name) or {} for name in TRAINING_STAGES}
    ev, demo = _done(out / "eval" / "done.json") or {}, _done(out / "demo" / "done.json") or {}
    lines = ["# kimi-vl quickstart report", "",
             f"Preset `{s['pretrain'].get('preset')}`; final checkpoint: `model/` (load with "
             "`AutoModelForImageTextToText.from_pretrained` after `import kimi_vl`).", "",
             "## Training", "", *vit_lines(s["vit"], times.get("vit", 0)),
             "| stage | steps | tokens | final train loss | validation loss | unigram baseline | "
             "wall time (s) |", "|---|---|---|---|---|---|---|"]
    for name in ("pretrain", "sft"):
        x = s[name]
        lines.append(f"| {name} | {x.get('steps')} | {x.get('tokens')} | {x.get('final_loss', 0):.3f} | "
                     f"{x.get('val_loss', 0):.3f} | {x.get('unigram_baseline', 0):.3f} | {times.get(name, 0):.0f} |")
    r = s["rl"]
    lines += ["", f"RL ({'+'.join(r.get('families') or [])}, {r.get('algorithm')}): {r.get('steps')} optimizer steps, "
              f"{r.get('updates_per_batch', 1)} per rollout batch of {r.get('prompts_per_step')} prompts x "
              f"{r.get('k')} responses; mean reward {r.get('reward_first_fifth', 0):.3f} (first fifth of the steps) -> "
              f"{r.get('reward_last_fifth', 0):.3f} (last fifth){_family_rewards(r)}; "
              f"tokens outside the log-ratio band {100 * r.get('masked_fraction', 0):.2f}%, "
              f"mean |log-ratio| {r.get('log_ratio_abs_mean', 0):.4f}; "
              f"{times.get('rl', 0):.0f} s.", "",
              _img(out / "pretrain/plots/loss.png", out, "pre-training loss"), "",
              _img(out / "pretrain/plots/max_logits.png", out, "max logits (QK-Clip)"), "",
              _img(out / "sft/plots/loss.png", out, "SFT loss"), "",
              _img(out / "rl/plots/rewards.png", out, "RL rewards"), "",
              _img(out / "rl/plots/rl_stats.png", out, "RL statistics"), ""]
    if ev:
        lines += evaluation_section(ev)
    if demo:
        lines += ["## Video to website", "",
                  f"Held-out screencast `demo/screencast.mp4` (target `demo/target.html`, output `demo/site.html`); "
                  f"generation stopped by `{demo['stop']}` after {demo['new_tokens']} tokens."
                  + (f" Its frames, as every screencast of the embedded data, are drawn in {demo['font']}."
                     if "font" in demo else "")]
        if demo["rendered"]:
            gap = gap_closed(demo["score"], demo["blank_page_score"], demo["true_page_score"])
            lines += [f"Visual similarity to the video's frames: {demo['score']:.3f} (a blank white page: "
                      f"{demo['blank_page_score']:.3f}, the true page: {demo['true_page_score']:.3f}): the page "
                      f"closes {100 * gap:.0f}% of the gap from blank to true."]
            if demo.get("fixed_page_scores"):  # absent in runs before the baseline was added
                fixed = sum(demo["fixed_page_scores"]) / len(demo["fixed_page_scores"])
                fixed_gap = gap_closed(fixed, demo["blank_page_score"], demo["true_page_score"])
                lines[-1] += (f" The constant-answer baseline, {len(demo['fixed_page_scores'])} fixed pages (true "
                              f"pages of training screencasts, the same whatever the video), scores {fixed:.3f} on the "
                              f"mean and closes {100 * fixed_gap:.0f}%: the page has read the video only as far as it "
                              f"scores above them.")
            lines += ["", _img(out / "demo/compare.png", out, "frame | render")]
        else:
            lines += ["Chromium is not installed, so the page was not rendered (`apt-get install chromium`)."]
        if demo.get("fields_read"):  # absent in runs before it was recorded
            right = [name for name, ok in demo["fields_read"].items() if ok]
            lines += ["", f"Of the {len(demo['fields_read'])} fields the page takes from the video "
                      f"(`page_fields_read`: title, colours, heights, button width; chance 1/16 to 1/4 each) it states "
                      f"{len(right)} right{': ' + ', '.join(right) if right else ''}."]
        lines.append("")
    lines += ["## Wall time", "", " | ".join(f"{k} {v:.0f} s" for k, v in times.items())
              + f" | total {sum(times.values()):.0f} s", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
