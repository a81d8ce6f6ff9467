"""On a 2-core CPU, is the quickstart's pre-training faster as two one-thread DDP processes than as one process with
two threads?

Each round runs `kimi-vl train pretrain` (the `tiny` preset, `--steps` steps from scratch, fresh output folder) four
ways, one after the other: one process with 2 torch threads and the preset's batch (the quickstart's 8 x 256
tokens); `torchrun --nproc_per_node 2` with 1 thread per process and half the rows each (the same tokens a step,
gradients averaged by DDP over gloo); one process with 1 thread and half the rows (what each DDP rank computes,
without the other rank or the all-reduce: the ceiling of the DDP side); and two such processes at once, independent
(what the two ranks cost each other by sharing the machine, without DDP's synchronisation). Prints each side's
seconds per step (a round's figure is the median of its steps after `--warmup`, from `metrics.jsonl`; then median
[min, max] over the rounds) and the DDP side's ratio to the quickstart's (per round, median [min, max]).

    python bench/cpu_processes.py --rounds 3 --steps 60
    python bench/cpu_processes.py --rounds 3 --steps 60 --drill-batches 0   # the mixture after the letter drill

The sides train on different batches (DDP rank r takes stream batch 2s + r), so their losses are not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import spread  # this script's folder: bench/

from kimi_vl.training.presets import get_preset

ROWS = get_preset("tiny").data["pretrain"].rows  # the quickstart's rows per step; each DDP rank takes half
HALF = ROWS // 2
SIDES = {  # name: (how the processes run, threads per process, rows per process)
    f"1 process x 2 threads, {ROWS} rows": ("alone", 2, ROWS),
    f"DDP: 2 processes x 1 thread, {HALF} rows each": ("ddp", 1, HALF),
    f"1 process x 1 thread, {HALF} rows (one rank alone)": ("alone", 1, HALF),
    f"2 independent processes x 1 thread, {HALF} rows each (no DDP)": ("pair", 1, HALF),
}


def _median_step(out: Path, warmup: int) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["step_time"] for r in records if "step_time" in r][warmup:])


def step_time(mode: str, threads: int, rows: int, args: argparse.Namespace) -> float:
    """Median seconds per step of `kimi-vl train pretrain` after `args.warmup` steps: one process (`alone`), a
    2-process DDP run (`ddp`; rank 0's log), or two independent runs at once (`pair`; the mean of their medians)."""
    tmp = Path(tempfile.mkdtemp(prefix="cpu_processes_"))
    try:
        launcher = ([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"] if mode == "ddp"
                    else [sys.executable])
        outs = [tmp / f"run{i}" for i in range(2 if mode == "pair" else 1)]
        procs = []
        for out in outs:
            cmd = [*launcher, "-m", "kimi_vl.cli", "train", "pretrain", "--out", str(out), "--steps", str(args.steps),
                   "--rows", str(rows), "--checkpoint-every", str(10 ** 6), "--val-every", "0", "--no-progress"]
            if args.drill_batches is not None:
                cmd += ["--drill-batches", str(args.drill_batches)]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            procs.append((cmd, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                text=True)))
        for cmd, proc in procs:
            _, err = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
        return statistics.mean(_median_step(out, args.warmup) for out in outs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of each run's median")
    ap.add_argument("--drill-batches", type=int, default=None,
                    help="passed to the runs (0: the full mixture from the first step; default: the preset's drill)")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    for r in range(args.rounds):
        for name, (mode, threads, rows) in SIDES.items():
            times[name].append(step_time(mode, threads, rows, args))
        print(f"round {r + 1}: " + ", ".join(f"{name} {t[-1]:.3f} s" for name, t in times.items()), flush=True)
    print(f"\nseconds per step (median [min, max] over {args.rounds} rounds, {args.steps} steps each, "
          f"{args.warmup} left out):")
    for name, t in times.items():
        print(f"  {name}: {spread(t, digits=3)}")
    base, ddp = list(times.values())[:2]
    print(f"DDP / one process: {spread([d / b for d, b in zip(ddp, base)], 'x')}")


if __name__ == "__main__":
    main()
