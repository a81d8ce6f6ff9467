"""What K2.5's token mask and log-ratio penalty change once the policy moves off its rollouts.

The quickstart's RL (2 optimizer steps per rollout batch at lr 1e-4) barely leaves its rollout policy: the mask fires
on a fraction of a percent of the tokens and the two objectives' rewards agree to the third decimal. Here the same
joint text-vision RL from each SFT checkpoint (`--from`) runs off-policy: `--updates-per-batch` optimizer steps on
each rollout batch at `--lr`, twice per seed, interleaved:

- `k25`: the K2.5 objective with the preset's band and penalty (alpha -0.5, beta 0.5, tau 0.01);
- `open`: the same run with the band wide open and no penalty (alpha -1000, beta 1000, tau 0): the ratio-weighted
  policy gradient, every token's gradient kept however far its log-ratio has moved.

Per run it reports, from `metrics.jsonl`, the share of tokens outside the band and the mean |log-ratio| on the
updates after the first of each batch (the first's ratio is exactly 1), the entropy of the sampling distribution
and the mean reward in the first and last fifth of the steps, and the proxies of the held-out evaluation split after
RL (`PROXY_EVAL_CONFIG`, as the quickstart evaluates). Last, the `k25 - open` differences with their mean and range
over every (checkpoint, seed) pair. Nothing is tuned on these scores: the regime is chosen by the band's firing
rate alone.

    python bench/rl_objective.py --from runs/qs18/seed0/sft runs/qs18/seed1/sft runs/qs18/seed2/sft --seeds 0 1 \
        --out runs/rl_objective
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

ARMS = {"k25": {}, "open": {"alpha": -1000.0, "beta": 1000.0, "tau": 0.0}}
"""The two objectives: the preset's K2.5 settings, and the band wide open without the penalty."""


def fifth(values: list[float], last: bool) -> float:
    n = max(1, len(values) // 5)
    part = values[-n:] if last else values[:n]
    return sum(part) / len(part)


def run_arm(from_dir: Path, out: Path, arm: str, seed: int, args: argparse.Namespace) -> dict:
    """One RL run and its evaluation; cached in `out` (a rerun reads finished runs back)."""
    from kimi_vl.eval.proxies import PROXY_EVAL_CONFIG
    from kimi_vl.eval.runner import evaluate
    from kimi_vl.training.stages import rl
    from kimi_vl.training.trainer import read_metrics

    t0 = time.perf_counter()
    rl(from_dir, out / "rl", families=["text", "vision"], seed=seed, steps=args.steps, lr=args.lr,
       updates_per_batch=args.updates_per_batch, progress=False, **ARMS[arm])
    seconds = time.perf_counter() - t0
    metrics = read_metrics(out / "rl" / "metrics.jsonl")
    later = [m for i, m in enumerate(metrics) if i % args.updates_per_batch]  # updates after a batch's first
    report = evaluate(out / "rl", ["mmlu_pro_synth", "mathvista_synth"], out / "eval",
                      dataclasses.replace(PROXY_EVAL_CONFIG, progress=False))["benchmarks"]
    rewards = [m["reward_mean"] for m in metrics]
    entropy = [m["entropy"] for m in metrics if "entropy" in m]
    return {"arm": arm, "seed": seed, "from": str(from_dir), "rl_seconds": seconds,
            "masked": statistics.fmean(m["masked_fraction"] for m in later),
            "masked_max": max(m["masked_fraction"] for m in later),
            "log_ratio": statistics.fmean(m["log_ratio_abs_mean"] for m in later),
            "reward_first": fifth(rewards, False), "reward_last": fifth(rewards, True),
            "entropy_first": fifth(entropy, False), "entropy_last": fifth(entropy, True),
            "mmlu_pro": report["mmlu_pro_synth"]["accuracy"], "mathvista": report["mathvista_synth"]["accuracy"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="from_dirs", nargs="+", required=True, help="SFT checkpoints to start RL from")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--updates-per-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/rl_objective")
    args = ap.parse_args()
    if args.steps % args.updates_per_batch:
        ap.error("--steps must be a multiple of --updates-per-batch (whole rollout batches)")
    root = Path(args.out)
    print(f"RL from {len(args.from_dirs)} SFT checkpoint(s), seeds {args.seeds}: {args.steps} optimizer steps, "
          f"{args.updates_per_batch} per rollout batch, lr {args.lr:g}\n")
    print("| checkpoint | seed | objective | tokens outside the band (mean / max) | mean abs log-ratio | entropy first "
          "-> last fifth | reward first -> last fifth | MMLU-Pro proxy | MathVista proxy | RL time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for i, from_dir in enumerate(args.from_dirs):
        for seed in args.seeds:
            for arm in ARMS:
                path = root / f"ckpt{i}" / f"seed{seed}" / arm
                done = path / "result.json"
                result = json.loads(done.read_text()) if done.is_file() else run_arm(Path(from_dir), path, arm, seed,
                                                                                      args)
                done.write_text(json.dumps(result, indent=1))
                rows.append(result)
                print(f"| {from_dir} | {seed} | {arm} | {100 * result['masked']:.2f}% / "
                      f"{100 * result['masked_max']:.2f}% | {result['log_ratio']:.4f} | "
                      f"{result['entropy_first']:.3f} -> {result['entropy_last']:.3f} | "
                      f"{result['reward_first']:.3f} -> {result['reward_last']:.3f} | "
                      f"{100 * result['mmlu_pro']:.1f}% | {100 * result['mathvista']:.1f}% | "
                      f"{result['rl_seconds']:.0f} |", flush=True)
    pairs = [(a, b) for a, b in zip(rows[::2], rows[1::2])]
    print("\nk25 - open over", len(pairs), "(checkpoint, seed) pairs: mean [min, max]")
    for key, label, unit in (("reward_last", "reward, last fifth", 1), ("entropy_last", "entropy, last fifth", 1),
                             ("mmlu_pro", "MMLU-Pro proxy (points)", 100), ("mathvista", "MathVista proxy (points)",
                                                                             100)):
        deltas = [unit * (a[key] - b[key]) for a, b in pairs]
        print(f"- {label}: {statistics.fmean(deltas):+.3f} [{min(deltas):+.3f}, {max(deltas):+.3f}]")


if __name__ == "__main__":
    main()
