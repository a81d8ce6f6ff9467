"""Is the working tree's training step faster than a git revision's, and does it compute the same numbers?

The `tiny` preset's own pre-training or SFT (its stream, model, MuonClip and `Trainer`), `--steps` steps from stream
index `--at`, run by this checkout's `kimi_vl` and by `--against`'s (extracted with `git archive` into a temporary
folder), one fresh process at a time, alternating, `--rounds` times each. Prints each side's seconds per step (median
[min, max] over the rounds; one round's figure is the median of its steps' `step_time`, after 2 warm-up steps), the
ratio, and whether the two sides' losses and final parameters are bit-identical (a speed-up that keeps them so leaves
every measured figure of a run valid on the machine that measured it).

    python bench/step_time.py --against HEAD~3 --stage pretrain --rounds 5 --steps 40 --at 500
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(stage: str, steps: int, at: int) -> dict:
    """One side's run in this process: seconds per step, losses and a hash of the final parameters."""
    import torch
    from data_workers import Shifted  # this script's folder: bench/

    import kimi_vl
    from kimi_vl.data.config import pretrain_data, sft_data
    from kimi_vl.training.config import resolve
    from kimi_vl.training.presets import get_preset
    from kimi_vl.training.stages import build_model, build_processor
    from kimi_vl.training.trainer import Trainer

    cfg = resolve(stage, "tiny", {"progress": False, "val_every": 0, "checkpoint_every": 10 ** 9, "steps": steps})
    processor = build_processor(cfg.data, None, 0)
    data = (pretrain_data if stage == "pretrain" else sft_data)(cfg.data, processor, 0)[0]
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), processor)
    with tempfile.TemporaryDirectory() as out:
        Trainer(model, Shifted(data, at), cfg.train, out).train()
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"package": str(Path(kimi_vl.__file__).parent), "step_time": statistics.median(
        r["step_time"] for r in records[2:]), "losses": [r["loss"] for r in records], "params": params}


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
    a, b = results[args.against][0], results["working tree"][0]
    same = a["losses"] == b["losses"] and a["params"] == b["params"]
    print(f"losses and final parameters bit-identical: {same}" + ("" if same else
          f" (largest loss difference {max(abs(x - y) for x, y in zip(a['losses'], b['losses'])):.3g})"))


if __name__ == "__main__":
    main()
