"""Does a data-loader process speed up the quickstart's training? The `tiny` preset's own pre-training or SFT (its
stream, model, MuonClip and `Trainer`), `--steps` steps at a time with `num_workers` 0 (batches built in the training
process) and 1 (one forked process builds them ahead), in interleaved rounds; prints each setting's seconds per step
(median [min, max] over the rounds), the ratio, and how much of a step building its batch takes.

    python bench/data_workers.py --stage pretrain --rounds 3 --steps 40 --at 0 1000

`--at` picks where in the stream the timed steps start (pre-training's first 450 batches are the option-letter
drill, later ones the full mixture). Batch `i` is a pure function of `(seed, i)` whoever builds it, so both settings
train on the same batches; the script checks that their losses agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kimi_vl.data.config import pretrain_data, sft_data
from kimi_vl.training.config import resolve
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import build_model, build_processor
from kimi_vl.training.trainer import Trainer

WARMUP = 2
"""First steps of each run left out of its median step time."""


class Shifted:
    """Batch `i` of `stream` is batch `i + offset` here: timed steps from any place of the stream."""

    def __init__(self, stream: Any, offset: int) -> None:
        self.stream, self.offset = stream, offset

    def batch(self, index: int) -> Any:
        return self.stream.batch(index + self.offset)


def timed_run(stage: str, data: Any, processor: Any, steps: int, workers: int) -> tuple[float, list[float]]:
    """Median seconds per step of `steps` training steps after the first `WARMUP` (`step_time` of the trainer's
    metrics: data, forward, backward, optimizer) and the losses of all."""
    cfg = resolve(stage, "tiny", {"progress": False, "val_every": 0, "checkpoint_every": 10 ** 9, "steps": steps})
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), processor)
    with tempfile.TemporaryDirectory() as out:
        Trainer(model, data, cfg.train, out, num_workers=workers).train()
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time"] for r in records[WARMUP:]), [r["loss"] for r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("pretrain", "sft"), default="pretrain")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, nargs="+", default=[0, 1000], help="stream index of the first timed batch")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed {WARMUP}: each run's first {WARMUP} steps are left out of its step time")
    cfg = resolve(args.stage, "tiny", {}, seed=0)
    processor = build_processor(resolve("pretrain", "tiny", {}, seed=0).data, seed=0)
    data, _, _ = (pretrain_data if args.stage == "pretrain" else sft_data)(cfg.data, processor, 0)
    print(f"tiny preset, {args.stage}, {torch.get_num_threads()} torch threads, {args.steps} steps a round, "
          f"{args.rounds} interleaved rounds")
    for at in args.at:
        shifted = Shifted(data, at)
        t0 = time.perf_counter()
        for i in range(args.steps):
            shifted.batch(i)
        build = (time.perf_counter() - t0) / args.steps
        per_step: dict[int, list[float]] = {0: [], 1: []}
        losses: dict[int, list[float]] = {}
        for _ in range(args.rounds):
            for workers in (0, 1):
                seconds, losses[workers] = timed_run(args.stage, shifted, processor, args.steps, workers)
                per_step[workers].append(seconds)
        med = {w: statistics.median(v) for w, v in per_step.items()}
        ratios = sorted(a / b for a, b in zip(per_step[0], per_step[1]))
        same = max(abs(a - b) for a, b in zip(losses[0], losses[1]))
        print(f"from batch {at}: building a batch {1000 * build:.0f} ms ({100 * build / med[0]:.0f}% of a step "
              f"without a worker); s/step workers 0: {med[0]:.3f} [{min(per_step[0]):.3f}, {max(per_step[0]):.3f}], "
              f"workers 1: {med[1]:.3f} [{min(per_step[1]):.3f}, {max(per_step[1]):.3f}]; "
              f"RATIO {statistics.median(ratios):.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}] faster with a worker; "
              f"losses differ by at most {same:.1e}")


if __name__ == "__main__":
    main()
