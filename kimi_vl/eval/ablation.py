"""The Vision-RL ablation (Kimi K2.5, Table 2): does RL on vision tasks also help text?

From one SFT checkpoint, for each seed, two RL runs with the same number of steps and rollouts: `text` (text tasks
only) and `text+vision` (text and image tasks). Both are then evaluated on a text benchmark (MMLU-Pro format) and a
vision benchmark (MathVista format): the real ones when `data_dir` holds them, else the offline synthetic proxies
(labelled as such; `ABLATION_PROXY_ITEMS` items). The report gives each arm's mean score, the delta
(text+vision minus text) with a 95% confidence interval over seeds (Student t on the per-seed paired deltas), a plot,
and the model and data it was run on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..progress import progress_bar
from ..training.stages import read_summary, rl, stage_complete
from .config import EvalConfig
from .generation import Engine
from .proxies import MMLU_PRO_SYNTH_SIZE, PROXY_EVAL_CONFIG
from .runner import evaluate

ARMS = {"text": ("text",), "text+vision": ("text", "vision")}
ABLATION_SEEDS = 8
"""Default seeds. A 95% half-width within 2 points needs `t * sd / sqrt(n) <= 2` for the per-seed deltas' standard
deviation `sd`. On `runs/qs14`'s seed-0 SFT checkpoint, with the proxies' `ABLATION_PROXY_ITEMS`, that SD measured
1.2-1.4 points on the MathVista proxy and 0.9-1.0 on the MMLU-Pro proxy (8 and 20 seeds), so 8 seeds give about
1 point and keep 2 up to an SD of 2.4; on `runs/qs15`'s three checkpoints the SDs were 0.6-1.1 and 0.3-0.8 (half-widths
0.3-0.9), on `runs/qs19`'s (the model counts) 0.9-1.3 and 0.7-1.0 (half-widths 0.6-1.1). 8 seeds took 8 min 23 s -
9 min 32 s on 2 Zen 5 cores; on the slow family-25 machine of docs/RESULTS.md one seed took 5 min 37 s (the SFT
checkpoint's evaluation 79 s, each seed's two arms 256 s), so the 8 take some 35 min there, past the 30 allowed,
and when its host was less loaded the 8 took 15 min 52 s (`runs/qs20`'s checkpoint, half-widths 0.5 and 1.1).
At the earlier RL, lr 2e-4 on 4 prompts, RL broke the text skill on one run in ten and even 24 seeds left the text
delta 2.5 wide."""
ABLATION_PROXY_ITEMS = {"mmlu_pro_synth": MMLU_PRO_SYNTH_SIZE, "mathvista_synth": 400}
"""Items of each proxy the ablation evaluates on (their first ones are the quickstart's pinned items). On the
MathVista proxy's 100 pinned items the two arms' paired deltas spread by 3.6 points (SD over 20 seeds on `runs/qs14`),
most of it which items a run happens to flip; on 400 items the same runs spread by 1.4. The MMLU-Pro proxy's 140
already give about 1 point."""

# Two-sided 95% Student t quantiles by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 20: 2.086, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """Two-sided 95% Student t quantile for `df` degrees of freedom: the tabulated one at the nearest df at or below
    it, never below the exact quantile (an interval at least as wide as the exact one; exact for df <= 10)."""
    if df < 1:
        raise ConfigError("a confidence interval needs at least two seeds.")
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (nan with a single value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan
    return m, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def vision_rl_ablation(sft_dir: str | Path, out_dir: str | Path, *, seeds: int = ABLATION_SEEDS,
                       steps: int | None = None, data_dir: str | Path | None = None, limit: int | None = None,
                       progress: bool = True, config: EvalConfig | None = None) -> dict[str, Any]:
    """Run the ablation (resumable: finished RL runs and cached responses are reused); returns the report dict and
    writes `ablation.json`, `ablation.md` and `ablation.png` under `out_dir`.

    `limit`: items per benchmark (none: all of a real benchmark, `ABLATION_PROXY_ITEMS` of a proxy). `config` holds
    the evaluation options; its `data_dir`, `limit` and `progress` are replaced by the arguments of the same names.
    Default: `PROXY_EVAL_CONFIG` on the proxies (the quickstart's settings, so scores compare with it), the official
    settings on real data.
    """
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}.")
    out_dir = Path(out_dir)
    benchmarks = ("mmlu_pro", "mathvista") if data_dir else ("mmlu_pro_synth", "mathvista_synth")
    options = config or (EvalConfig() if data_dir else PROXY_EVAL_CONFIG)
    items = {b: limit if limit is not None or data_dir else ABLATION_PROXY_ITEMS[b] for b in benchmarks}
    configs = {b: dataclasses.replace(options, data_dir=data_dir, limit=items[b], progress=progress)
               for b in benchmarks}  # checked here, before any run

    def score(model_dir: Path, eval_dir: Path) -> dict[str, dict[str, Any]]:
        # the engine named by its absolute path (the response caches are keyed on its weights; the report names it)
        engine = Engine.from_pretrained(model_dir.resolve(), device=options.device, dtype=options.dtype,
                                        trust_remote_code=options.trust_remote_code, progress=progress)
        return {b: evaluate(engine, [b], eval_dir / b, configs[b])["benchmarks"][b] for b in benchmarks}

    sft_scores = score(Path(sft_dir), out_dir / "sft_eval")
    scores: dict[str, dict[str, list[float]]] = {arm: {b: [] for b in benchmarks} for arm in ARMS}
    start_rewards: dict[str, dict[str, list[float]]] = {arm: {f: [] for f in fams} for arm, fams in ARMS.items()}
    runs = [(seed, arm, out_dir / f"{arm.replace('+', '_')}_seed{seed}") for seed in range(seeds) for arm in ARMS]
    trained = [stage_complete(run_dir / "model") for _, _, run_dir in runs]  # a rerun's: reused, not counted again
    # The whole job's line (each run's RL and evaluation show their own): the run now going, the runs done, time left.
    bar = progress_bar(total=len(runs), initial=sum(trained), desc="vision-rl ablation", enabled=progress, unit="run")
    labels = [f"vision-rl ablation [{arm}, seed {seed}]" for seed, arm, _ in runs] + ["vision-rl ablation [done]"]
    bar.set_description(labels[0])
    for (seed, arm, run_dir), was_trained, following in zip(runs, trained, labels[1:]):
        rl(sft_dir, run_dir / "model", families=list(ARMS[arm]), seed=seed, progress=progress,
           **({} if steps is None else {"steps": steps}))
        for family, reward in ((read_summary(run_dir / "model") or {}).get("family_reward_first_fifth")
                               or {}).items():
            start_rewards[arm][family].append(reward)
        for b, entry in score(run_dir / "model", run_dir / "eval").items():
            scores[arm][b].append(entry["accuracy"])
        bar.set_description(following)
        bar.update(0 if was_trained else 1)
    bar.close()
    summary = read_summary(out_dir / "text_seed0" / "model") or {}
    result = {
        "sft_checkpoint": str(sft_dir), "seeds": seeds, "rl_steps": summary.get("steps"),
        "rl_prompts_per_step": summary.get("prompts_per_step"), "rl_k": summary.get("k"),
        "rl_updates_per_batch": summary.get("updates_per_batch"),
        "preset": summary.get("preset"), "benchmarks": list(benchmarks), "proxies": data_dir is None, "items": items,
        "eval_options": options.changes(),
        "start_reward": {arm: {f: statistics.fmean(v) if v else None for f, v in rewards.items()}
                         for arm, rewards in start_rewards.items()},
        "baselines": {b: {"chance": e["chance"], "constant": e["constant"], "sft": e["accuracy"]}
                      for b, e in sft_scores.items()},
        "scores": scores, "summary": {},
    }
    for b in benchmarks:
        deltas = [tv - t for t, tv in zip(scores["text"][b], scores["text+vision"][b])]
        result["summary"][b] = {
            "text": mean_ci(scores["text"][b]), "text+vision": mean_ci(scores["text+vision"][b]),
            "delta": mean_ci(deltas),
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ablation.json").write_text(json.dumps(_strict_json(result), indent=1, allow_nan=False))
    (out_dir / "ablation.md").write_text(ablation_markdown(result))
    plot_ablation(result, out_dir / "ablation.png")
    return result


def _strict_json(value: Any) -> Any:
    """`value` with every NaN (the half-width of a single seed's interval) as None, so that the file is standard
    JSON that any parser reads."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _pct(mean: float, half: float) -> str:
    return f"{100 * mean:.1f}" + ("" if math.isnan(half) else f" ± {100 * half:.1f}")


def ablation_markdown(result: dict[str, Any]) -> str:
    proxy = " (synthetic proxy)" if result["proxies"] else ""
    lines = [
        "# Vision-RL ablation", "",
        f"From the SFT checkpoint `{result['sft_checkpoint']}` (preset `{result['preset']}`), RL with text tasks "
        f"only vs text + vision tasks: {result['rl_steps']} optimizer step{'' if result['rl_steps'] == 1 else 's'}, "
        f"{result.get('rl_updates_per_batch') or 1} per rollout batch of {result['rl_prompts_per_step']} text prompts "
        f"(plus as many vision prompts in the text+vision arm) x {result['rl_k']} responses each, "
        f"{result['seeds']} seed(s). Scores are accuracies in %, mean ± the 95% "
        "confidence half-width over seeds (Student t; the delta's interval is over the paired per-seed deltas), "
        "beside chance, the constant answer and the SFT checkpoint itself on the same items.",
        "",
        "| benchmark | chance | constant answer | SFT checkpoint | RL text | RL text+vision | delta (vision - text) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, s in result["summary"].items():
        base = result["baselines"][b]
        lines.append(f"| {b}{proxy} | {100 * base['chance']:.1f} | {100 * base['constant']:.1f} | "
                     f"{100 * base['sft']:.1f} | {_pct(*s['text'])} | {_pct(*s['text+vision'])} | "
                     f"{_pct(*s['delta'])} |")
    vision = result.get("start_reward", {}).get("text+vision", {}).get("vision")
    if vision is not None:
        lines += ["", f"Mean reward at the start of RL (first fifth of the steps, mean over seeds): text tasks "
                  f"{result['start_reward']['text+vision']['text']:.3f}, vision tasks {vision:.3f}"
                  + (" -- near zero: the vision arm earns almost no reward, so this ablation is not informative."
                     if vision < 0.05 else ".")]
    items = ", ".join(f"{b} {n or 'all'}" for b, n in result["items"].items())
    lines += ["", f"Items per benchmark: {items}; evaluation options: "
              f"{result.get('eval_options') or 'the official settings'}. "
              + ("The benchmarks are the offline synthetic proxies built from the embedded synthetic world, not "
                 "MMLU-Pro and MathVista themselves; a tiny model trained for minutes on a CPU is far from the "
                 "scale of the K2.5 result (+1.7 to +2.2 points on MMLU-Pro, GPQA-Diamond and LongBench v2), so "
                 "read deltas against their intervals." if result["proxies"] else "Real benchmark data."), ""]
    return "\n".join(lines)


def plot_ablation(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = list(result["summary"])
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for i, arm in enumerate(ARMS):
        means = [100 * result["summary"][b][arm][0] for b in benchmarks]
        errs = [0 if math.isnan(h := result["summary"][b][arm][1]) else 100 * h for b in benchmarks]
        ax.bar([j + (i - 0.5) * width for j in range(len(benchmarks))], means, width, yerr=errs, capsize=4,
               label=f"RL {arm}")
    for j, b in enumerate(benchmarks):
        base = result["baselines"][b]
        for key, style, label in (("sft", "-", "SFT checkpoint"), ("constant", "--", "constant answer")):
            ax.hlines(100 * base[key], j - width, j + width, colors="black", linestyles=style,
                      label=label if j == 0 else None)
    ax.set_xticks(range(len(benchmarks)), benchmarks)
    ax.set(ylabel="accuracy (%)", title="Vision-RL ablation (95% CI over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
