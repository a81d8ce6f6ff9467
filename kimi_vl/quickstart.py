"""`kimi-vl quickstart`: the whole pipeline on the embedded default data, offline, resumable.

Stages, each in its own directory under `out` and skipped when already finished (rerunning after an interruption
continues from the last finished stage, and inside a training stage from its last checkpoint):

1. `pretrain/`  tokenizer + joint text-vision pre-training (AttnRes, MuonClip, constant vision ratio)
2. `sft/`       zero-vision SFT (text-only chats)
3. `rl/`        joint text-vision RL (K2.5 objective, verifiable rewards)
4. `eval/`      MMLU-Pro and MathVista (real data with `data_dir`, else the synthetic proxies, labelled) for the
                pre-trained, SFT and RL models
5. `demo/`      video-to-website on a held-out generated screencast (rendered and scored when Chromium is there)
6. `model/`     the final Hugging Face checkpoint, and `REPORT.md` with tables and plots
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .export import add_remote_code
from .training.presets import get_preset
from .training.stages import pretrain, read_summary, rl, sft

STAGES = ("pretrain", "sft", "rl", "eval", "demo", "report")
DEMO_SEED = 1_000_000  # far from every training seed: the demo's screencast is held out
CHECKPOINT_FILES = ("config.json", "model.safetensors", "generation_config.json", "processor_config.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "preprocessor_config.json", "video_preprocessor_config.json",
                    "training_summary.json")


def _done(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _scaled(n: int, scale: float) -> int:
    return max(2, round(n * scale))


EVAL_STAGES = {"pretrain": "after pre-training", "sft": "after SFT", "rl": "after RL"}
"""The checkpoints `run_eval` evaluates, with their REPORT.md column headings."""


def run_eval(out: Path, data_dir: str | Path | None, limit: int | None, progress: bool) -> dict[str, Any]:
    """Evaluate the pre-trained, SFT and RL checkpoints (the same prompts for all three: the pre-trained model has
    seen chats only with images, so its text scores show what SFT adds); proxies use `PROXY_EVAL_CONFIG`, real
    benchmarks their official settings."""
    import dataclasses

    from .eval.config import EvalConfig
    from .eval.proxies import PROXY_EVAL_CONFIG
    from .eval.runner import evaluate

    marker = out / "eval" / "done.json"
    if (done := _done(marker)) is not None:
        return done
    if data_dir is None:
        benchmarks, options = ["mmlu_pro_synth", "mathvista_synth"], PROXY_EVAL_CONFIG
    else:
        benchmarks, options = ["mmlu_pro", "mathvista"], EvalConfig()
    config = dataclasses.replace(options, data_dir=data_dir, limit=limit, progress=progress)
    results = {}
    for name in EVAL_STAGES:
        report = evaluate(out / name, benchmarks, out / "eval" / name, config)
        results[name] = {b: {k: v for k, v in e.items() if k in ("accuracy", "correct", "total", "proxy")}
                         for b, e in report["benchmarks"].items()}
    results["chance"] = chance_levels(benchmarks, limit)
    results["settings"] = options.changes()
    marker.write_text(json.dumps(results, indent=1))
    return results


def chance_levels(benchmarks: list[str], limit: int | None) -> dict[str, float]:
    """Expected accuracy of uniform random guessing on each proxy (multiple choice: 1 / options; free form: 0)."""
    import tempfile

    from .data.world import mathvista_rows, mmlu_pro_rows
    from .eval.proxies import MATHVISTA_SYNTH_SIZE, MMLU_PRO_SYNTH_SIZE, PROXY_SEED

    out = {}
    if "mmlu_pro_synth" in benchmarks:
        rows = mmlu_pro_rows(limit or MMLU_PRO_SYNTH_SIZE, PROXY_SEED)
        out["mmlu_pro_synth"] = sum(1 / len(r["options"]) for r in rows) / len(rows)
    if "mathvista_synth" in benchmarks:
        with tempfile.TemporaryDirectory() as tmp:
            rows = list(mathvista_rows(limit or MATHVISTA_SYNTH_SIZE, PROXY_SEED, Path(tmp)).values())
        out["mathvista_synth"] = sum(1 / len(r["choices"]) if r["question_type"] == "multi_choice" else 0.0
                                     for r in rows) / len(rows)
    return out


def run_demo(out: Path, model_dir: Path) -> dict[str, Any]:
    """video2web on a held-out screencast; scored against the frames when Chromium is available, with a blank white
    page's score on the same frames as the baseline."""
    import random

    import numpy as np
    from PIL import Image

    from .data.screencast import make_screencast, write_video
    from .demos.render import BrowserNotFoundError, find_chromium
    from .demos.similarity import page_similarity
    from .demos.video2web import run_video2web

    marker = out / "demo" / "done.json"
    if (done := _done(marker)) is not None:
        return done
    demo = out / "demo"
    demo.mkdir(parents=True, exist_ok=True)
    cast = make_screencast(random.Random(DEMO_SEED))
    video = write_video(cast.frames, demo / "screencast.mp4", cast.fps)
    (demo / "target.html").write_text(cast.html)
    try:
        find_chromium()
        render = True
    except BrowserNotFoundError:
        render = False
    result = run_video2web(video, model_dir, demo, render=render, max_new_tokens=256)
    frames = [np.asarray(f) for f in cast.frames]
    w, h = cast.frames[0].size
    blank = page_similarity(frames, Image.new("RGB", (w, 8 * h), "white")).score
    summary = {"video": str(video), "site": str(result.site), "stop": result.stop, "new_tokens": result.new_tokens,
               "rendered": render, "score": (result.score or {}).get("score"), "blank_page_score": blank,
               "compare": str(result.compare) if result.compare else None}
    marker.write_text(json.dumps(summary, indent=1))
    return summary


def export_final(out: Path, source: Path) -> Path:
    """Copy the final checkpoint's Hugging Face files (not its training state) to `out/model`, self-contained
    (remote code and `auto_map`, as every stage writes them)."""
    final = out / "model"
    final.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, final / name)
    return add_remote_code(final)


def quickstart(out: str | Path = "runs/quickstart", *, preset: str = "tiny", data_dir: str | Path | None = None,
               scale: float = 1.0, eval_limit: int | None = None, seed: int = 0, progress: bool = True) -> Path:
    """Run (or resume) every stage; returns the path of `REPORT.md`. `scale` multiplies every stage's step count
    (e.g. 0.05 for a smoke run); `eval_limit` caps the items per benchmark."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = get_preset(preset)
    times = _done(out / "stage_times.json") or {}
    bar = tqdm(STAGES, desc="quickstart", disable=not progress, dynamic_ncols=True)
    for stage in bar:
        bar.set_description(f"quickstart [{stage}]")
        t0 = time.perf_counter()
        if stage == "pretrain":
            pretrain(out / "pretrain", preset=preset, steps=_scaled(p.stages["pretrain"].steps, scale), seed=seed,
                     progress=progress)
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
            export_final(out, out / "rl")
            write_report(out, times)
        times.setdefault(stage, time.perf_counter() - t0)
        (out / "stage_times.json").write_text(json.dumps(times, indent=1))
    return out / "REPORT.md"


def _img(path: Path, out: Path, alt: str) -> str:
    return f"![{alt}]({path.relative_to(out)})" if path.is_file() else f"({alt}: not produced)"


def write_report(out: Path, times: dict[str, float]) -> Path:
    """`REPORT.md`: stage summaries, evaluation scores against chance, RL rewards, the demo, and the plots."""
    s = {name: read_summary(out / name) or {} for name in ("pretrain", "sft", "rl")}
    ev, demo = _done(out / "eval" / "done.json") or {}, _done(out / "demo" / "done.json") or {}
    lines = ["# kimi-vl quickstart report", "",
             f"Preset `{s['pretrain'].get('preset')}`; final checkpoint: `model/` (load with "
             "`AutoModelForImageTextToText.from_pretrained` after `import kimi_vl`).", "",
             "## Training", "", "| stage | steps | tokens | final train loss | validation loss | unigram baseline | "
             "wall time (s) |", "|---|---|---|---|---|---|---|"]
    for name in ("pretrain", "sft"):
        x = s[name]
        lines.append(f"| {name} | {x.get('steps')} | {x.get('tokens')} | {x.get('final_loss', 0):.3f} | "
                     f"{x.get('val_loss', 0):.3f} | {x.get('unigram_baseline', 0):.3f} | {times.get(name, 0):.0f} |")
    r = s["rl"]
    lines += ["", f"RL ({'+'.join(r.get('families') or [])}, {r.get('algorithm')}): {r.get('steps')} steps of "
              f"{r.get('prompts_per_step')} prompts x {r.get('k')} responses; mean reward "
              f"{r.get('reward_first_fifth', 0):.3f} (first fifth of the steps) -> "
              f"{r.get('reward_last_fifth', 0):.3f} (last fifth); "
              f"{times.get('rl', 0):.0f} s.", "",
              _img(out / "pretrain/plots/loss.png", out, "pre-training loss"), "",
              _img(out / "pretrain/plots/max_logits.png", out, "max logits (QK-Clip)"), "",
              _img(out / "sft/plots/loss.png", out, "SFT loss"), "",
              _img(out / "rl/plots/rewards.png", out, "RL rewards"), "",
              _img(out / "rl/plots/rl_stats.png", out, "RL statistics"), ""]
    if ev:
        proxy = any(e.get("proxy") for e in ev.get("sft", {}).values())
        stages = [name for name in EVAL_STAGES if name in ev]
        lines += ["## Evaluation" + (" (synthetic proxies, not the real benchmarks)" if proxy else ""), "",
                  "| benchmark | chance | " + " | ".join(EVAL_STAGES[n] for n in stages) + " |",
                  "|---|---|" + "---|" * len(stages)]
        for task in ev.get("sft", {}):
            chance = ev.get("chance", {}).get(task)
            cells = [f"{100 * ev[n][task]['accuracy']:.1f}% ({ev[n][task]['correct']}/{ev[n][task]['total']})"
                     for n in stages]
            lines.append(f"| {task} | {'' if chance is None else f'{100 * chance:.1f}%'} | " + " | ".join(cells)
                         + " |")
        lines += ["", "Accuracy is the benchmark's own generative protocol: greedy generation, the official answer "
                  "extraction (MathVista: its rules, then a rule-based stand-in for its GPT extractor) and "
                  "scoring (MMLU-Pro: a response without an extractable letter gets the official random guess); "
                  "chance is the expected accuracy of uniform guessing.",
                  f"Settings: {ev.get('settings')}. Per-item responses and per-category reports are under "
                  + ", ".join(f"`eval/{n}/`" for n in stages) + ".", ""]
    if demo:
        lines += ["## Video to website", "",
                  f"Held-out screencast `demo/screencast.mp4` (target `demo/target.html`, output `demo/site.html`); "
                  f"generation stopped by `{demo['stop']}` after {demo['new_tokens']} tokens."]
        if demo["rendered"]:
            lines += [f"Visual similarity to the video's frames: {demo['score']:.3f} (a blank white page: "
                      f"{demo['blank_page_score']:.3f}).", "", _img(out / "demo/compare.png", out, "frame | render")]
        else:
            lines += ["Chromium is not installed, so the page was not rendered (`apt-get install chromium`)."]
        lines.append("")
    lines += ["## Wall time", "", " | ".join(f"{k} {v:.0f} s" for k, v in times.items())
              + f" | total {sum(times.values()):.0f} s", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
