"""The quickstart's figures over seeds: `kimi-vl quickstart --seed s` for each seed (each in its own folder,
resumable), then every proxy figure's mean and spread (min-max) and each seed's value, and the issue's goals checked
on the mean and on every seed.

    python bench/quickstart_seeds.py --out runs/qs_seeds --seeds 0 1 2

Figures: both proxies after pre-training, SFT and RL and on the fresh draw, MathVista's two parts after RL, the
constant-answer baselines, the demo's share of the blank-to-true gap, the final model's teacher-forced image colour
(`skills.colour_accuracy`, held-out items), and the wall time. The table is printed and written to `OUT/seeds.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from skills import colour_accuracy
from transformers import AutoModelForImageTextToText, AutoProcessor

from kimi_vl.demos.similarity import gap_closed
from kimi_vl.quickstart import quickstart

GOALS = (
    ("MathVista proxy after RL >= 40%", lambda f: f["mathvista_synth/rl"], 40),
    ("MathVista proxy after RL - constant answer >= 25 points",
     lambda f: f["mathvista_synth/rl"] - f["mathvista_synth/constant"], 25),
    ("counting part after RL >= 25%", lambda f: f["mathvista_synth/rl/general-vqa"], 25),
    ("charts and diagrams part after RL >= 25%", lambda f: f["mathvista_synth/rl/math-targeted-vqa"], 25),
    ("MMLU-Pro proxy after RL >= 75%", lambda f: f["mmlu_pro_synth/rl"], 75),
    ("fresh draw - pinned items (MathVista proxy), within 5 points",
     lambda f: -abs(f["mathvista_synth/fresh"] - f["mathvista_synth/rl"]), -5),
    ("zero-vision SFT - pre-training (MathVista proxy) >= 0 points",
     lambda f: f["mathvista_synth/sft"] - f["mathvista_synth/pretrain"], 0),
    ("image colour, teacher-forced, final model >= 90%", lambda f: f["skills/colour"], 90),
    ("video2web: share of the blank-to-true gap closed >= 30%", lambda f: f["video2web/gap"], 30),
    ("total wall time <= 20 min (as -minutes)", lambda f: -f["wall_time_min"], -20),
)
"""(goal, value of a run's figures, threshold): met when the value reaches the threshold on the mean of the seeds;
each seed must come within 5 points of it."""


def proxy_figures(ev: dict) -> dict[str, float]:
    """The proxy figures (percent) of a quickstart's `eval/done.json`: each stage's accuracy, the parts after RL, and
    the pinned items' chance and constant answer."""
    out: dict[str, float] = {}
    for stage in ("pretrain", "sft", "rl", "fresh"):
        for name, entry in ev.get(stage, {}).items():
            out[f"{name}/{stage}"] = 100 * entry["accuracy"]
            if stage == "rl":  # the baselines of the pinned items (the fresh draw has its own)
                out[f"{name}/constant"] = 100 * entry["constant"]
                out[f"{name}/chance"] = 100 * entry["chance"]
                for part, c in entry.get("categories", {}).items():
                    out[f"{name}/rl/{part}"] = 100 * c["accuracy"]
                    if "constant" in c:  # the part's own constant answer (MathVista's two categories)
                        out[f"{name}/rl/{part}/constant"] = 100 * c["constant"]
    return out


def figures(run: Path) -> dict[str, float]:
    """A finished quickstart folder's figures (percent, minutes)."""
    out = proxy_figures(json.loads((run / "eval" / "done.json").read_text()))
    demo = json.loads((run / "demo" / "done.json").read_text())
    if demo.get("true_page_score") is not None:
        out["video2web/gap"] = 100 * gap_closed(demo["score"], demo["blank_page_score"], demo["true_page_score"])
        if demo.get("fixed_page_scores"):  # the constant-answer baseline (runs before it was added have none)
            fixed = statistics.fmean(demo["fixed_page_scores"])
            out["video2web/fixed_pages_gap"] = 100 * gap_closed(fixed, demo["blank_page_score"],
                                                                demo["true_page_score"])
    model = AutoModelForImageTextToText.from_pretrained(run / "model").eval()
    out["skills/colour"] = 100 * colour_accuracy(model, AutoProcessor.from_pretrained(run / "model"), split="eval")
    out["wall_time_min"] = sum(json.loads((run / "stage_times.json").read_text()).values()) / 60
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/qs_seeds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    runs = {s: Path(args.out) / f"seed{s}" for s in args.seeds}
    for seed, run in runs.items():
        quickstart(run, preset=args.preset, seed=seed)
    per_seed = {s: figures(run) for s, run in runs.items()}
    keys = sorted(set.intersection(*(set(f) for f in per_seed.values())))
    lines = [f"| figure | mean | min-max | {' | '.join(f'seed {s}' for s in runs)} |",
             "|---|---|---|" + "---|" * len(runs)]
    mean = {}
    for key in keys:
        values = [per_seed[s][key] for s in runs]
        mean[key] = statistics.fmean(values)
        lines.append(f"| {key} | {mean[key]:.1f} | {min(values):.1f}-{max(values):.1f} | "
                     + " | ".join(f"{v:.1f}" for v in values) + " |")
    lines += ["", "| goal | mean | met on the mean | seeds within 5 points |", "|---|---|---|---|"]
    for name, value, threshold in GOALS:
        try:
            on_mean = value(mean)
            on_seeds = [value(per_seed[s]) >= threshold - 5 for s in runs]
        except KeyError as missing:
            lines.append(f"| {name} | not measured ({missing}) | | |")
            continue
        lines.append(f"| {name} | {on_mean:.1f} | {'yes' if on_mean >= threshold else 'NO'} | "
                     f"{sum(on_seeds)}/{len(runs)} |")
    table = "\n".join(lines) + "\n"
    print(table)
    (Path(args.out) / "seeds.md").write_text(table)


if __name__ == "__main__":
    main()
