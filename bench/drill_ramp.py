"""When the tiny preset's pre-training learns the option-letter lookup, with and without the drill's easy start.

Runs the `tiny` preset's own pre-training (its stream, model, MuonClip and `Trainer`; nothing else changed) for each
`--ramp` value of `drill_ramp_batches` and each seed, and every `--every` steps prints the teacher-forced skills of
`skills.py` on validation items: `letter` (the MMLU-Pro proxy's option letter), `drill` (bare option lists, 10
options) and `colour` (a shape's colour). With `--ramp 0` the drill asks about 3-10 options from its first batch;
with the preset's 300, about 2-3 options in the first 150 batches and 2-6 in the next 150 (`drill_option_range`).

    python bench/drill_ramp.py --seeds 0 1 2 3 --ramp 0 300 --steps 750

Each run takes 6-7 minutes on one core; `--jobs 2` runs two at a time (one thread each). `--threads 2 --jobs 1`
does the float arithmetic of the quickstart on 2 cores, so a seed's run repeats that seed's quickstart pre-training
step for step (the probes change nothing in it); `--drill-batches` lengthens or shortens the drill.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import time
from typing import Any

import torch
from skills import colour_accuracy, drill_accuracy, letter_accuracy

from kimi_vl.data.config import pretrain_data
from kimi_vl.training.config import resolve
from kimi_vl.training.muonclip import MuonClip
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import build_model, build_processor
from kimi_vl.training.trainer import Trainer


class ProbingTrainer(Trainer):
    """The preset's `Trainer`, probing the skills every `every` steps and stopping after `stop` steps."""

    def __init__(self, *args: Any, processor: Any, every: int, stop: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.processor, self.every, self.stop, self.probes = processor, every, stop, []

    def _log(self, record: dict[str, Any]) -> None:
        super()._log(record)
        if record["step"] % self.every == 0:
            model = self.raw_model.eval()
            with torch.no_grad():
                self.probes.append({"step": record["step"], "letter": letter_accuracy(model, self.processor, "val"),
                                    "drill": drill_accuracy(model, self.processor),
                                    "colour": colour_accuracy(model, self.processor, "val", n=60)})
            self.balancing.reset()  # probe forwards feed neither the router balance nor QK-Clip
            if isinstance(self.inner_optimizer, MuonClip):
                self.inner_optimizer.reset_max_logits()
            model.train()
        if record["step"] >= self.stop:
            self.cfg.steps = record["step"]  # ends the loop after this step (the schedule was set up for all steps)


def run(job: tuple[int, int, int, int, str, int, dict[str, Any]]) -> tuple[int, int, list[dict[str, float]], float]:
    seed, ramp, steps, every, out, threads, overrides = job
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cfg = resolve("pretrain", "tiny", {"drill_ramp_batches": ramp, "progress": False, "val_every": 0,
                                       "checkpoint_every": 10 ** 9, **overrides}, seed=seed)
    processor = build_processor(cfg.data, seed=seed)
    torch.manual_seed(seed)
    model = build_model(get_preset("tiny"), processor)
    data, _, _ = pretrain_data(cfg.data, processor, seed)
    trainer = ProbingTrainer(model, data, cfg.train, f"{out}/seed{seed}_ramp{ramp}", processor=processor,
                             every=every, stop=steps)
    trainer.train()
    return seed, ramp, trainer.probes, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--ramp", type=int, nargs="+", default=[0, 300], help="values of drill_ramp_batches")
    ap.add_argument("--steps", type=int, default=750, help="steps run of the preset's schedule (the first ones)")
    ap.add_argument("--every", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="threads per run (2 with --jobs 1: the quickstart's own "
                    "float arithmetic on 2 cores, so a run repeats its pre-training step for step)")
    ap.add_argument("--drill-batches", type=int, help="drill_batches (default: the preset's)")
    ap.add_argument("--any-letters", action=argparse.BooleanOptionalAction, default=None,
                    help="drill_any_letters (default: the preset's)")
    ap.add_argument("--out", default="runs/drill_ramp")
    args = ap.parse_args()
    overrides = {k: v for k, v in (("drill_batches", args.drill_batches), ("drill_any_letters", args.any_letters))
                 if v is not None}
    jobs = [(s, r, args.steps, args.every, args.out, args.threads, overrides)
            for r, s in itertools.product(args.ramp, args.seeds)]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(run, jobs, chunksize=1)
    steps = [p["step"] for p in results[0][2]]
    print("Teacher-forced accuracy (%) on validation items, letter / drill / colour, at steps "
          + ", ".join(map(str, steps)) + ":\n")
    print("| drill_ramp_batches | seed | " + " | ".join(f"step {s}" for s in steps) + " | time (s) |")
    print("|---|---|" + "---|" * len(steps) + "---|")
    for seed, ramp, probes, seconds in results:
        cells = [f"{100 * p['letter']:.1f} / {100 * p['drill']:.1f} / {100 * p['colour']:.1f}" for p in probes]
        print(f"| {ramp} | {seed} | " + " | ".join(cells) + f" | {seconds:.0f} |")


if __name__ == "__main__":
    main()
