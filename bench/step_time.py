"""Is the working tree's training step faster than a git revision's, and does it compute the same numbers?

The `tiny` preset's own pre-training or SFT (its stream, model, MuonClip and `Trainer`), `--steps` steps from stream
index `--at`, run by this checkout's `kimi_vl` and by `--against`'s (extracted with `git archive` into a temporary
folder), one fresh process at a time, alternating, `--rounds` times each. Prints each side's seconds per step (median
[min, max] over the rounds; one round's figure is the median of its steps' `step_time`, after 2 warm-up steps), the
ratio, and whether the two sides' losses are bit-identical at every step (a speed-up that keeps them so leaves every
measured figure of a run valid on the machine that measured it).

    python bench/step_time.py --against HEAD~3 --stage pretrain --rounds 5 --steps 40 --at 500
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(stage: str, steps: int, at: int) -> dict:
    """One side's run in this process (`data_workers.timed_run`, no loader process): seconds per step, losses."""
    from data_workers import Shifted, timed_run  # this script's folder: bench/

    import kimi_vl
    from kimi_vl.data.config import pretrain_data, sft_data
    from kimi_vl.training.config import resolve
    from kimi_vl.training.stages import build_processor

    processor = build_processor(resolve("pretrain", "tiny", {}, seed=0).data, seed=0)
    build = pretrain_data if stage == "pretrain" else sft_data
    data = build(resolve(stage, "tiny", {}, seed=0).data, processor, 0)[0]
    seconds, losses = timed_run(stage, Shifted(data, at), processor, steps, 0)
    return {"package": str(Path(kimi_vl.__file__).parent), "step_time": seconds, "losses": losses}


def run_side(root: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, __file__, "--worker", "--stage", args.stage, "--steps", str(args.steps), "--at",
           str(args.at)]
    out = subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["package"]) != root / "kimi_vl":
        raise SystemExit(f"the run meant for {root} imported kimi_vl from {result['package']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="git revision to compare with (default: HEAD)")
    ap.add_argument("--stage", choices=("pretrain", "sft"), default="pretrain")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, default=500, help="stream index of the first batch (pre-training's first 450 "
                    "batches are the option-letter drill)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= 2:
        ap.error("--steps must exceed 2: each run's first 2 steps are left out of its step time")
    if args.worker:
        print(json.dumps(worker(args.stage, args.steps, args.at)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.against, "kimi_vl"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        sides = {args.against: old, "working tree": REPO}
        results: dict[str, list[dict]] = {name: [] for name in sides}
        for r in range(args.rounds):
            for name, root in sides.items():
                results[name].append(run_side(root, args))
                print(f"round {r + 1}/{args.rounds} {name}: {results[name][-1]['step_time']:.3f} s/step", flush=True)
    times = {name: [x["step_time"] for x in res] for name, res in results.items()}
    for name, t in times.items():
        print(f"{name}: {statistics.median(t):.3f} s/step [{min(t):.3f}, {max(t):.3f}] over {len(t)} rounds")
    ratio = statistics.median(times["working tree"]) / statistics.median(times[args.against])
    print(f"working tree / {args.against}: {ratio:.3f} (the {args.stage} step takes {100 * (1 - ratio):.1f}% less "
          "time)")
    a, b = results[args.against][0]["losses"], results["working tree"][0]["losses"]
    same = a == b
    print(f"losses of every step bit-identical: {same}" + ("" if same else
          f" (largest difference {max(abs(x - y) for x, y in zip(a, b)):.3g})"))


if __name__ == "__main__":
    main()
