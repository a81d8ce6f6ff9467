"""A preset's stages on a CUDA GPU for a few steps each, in this process: step time, tokens/s, peak memory.

Runs `kimi-vl train pretrain` (then `sft` and `rl` from it) through `kimi_vl.cli.main` and reads each stage's
`metrics.jsonl`: the median step time after the first `--skip` steps (Triton compiles and the allocator warms up
there), tokens per step and per second, the loss at the first and last step, and the peak CUDA memory of the
stage (`torch.cuda.max_memory_allocated`). The `small` preset is the single-GPU recipe (bf16, one 80 GB GPU);
this is how we know it fits and how fast it steps. Each step is also printed as it is logged (`STEP` lines: its
time, loss and the peak memory so far), so a run cut short by a time limit still says how far it got and how fast.

Run: `python bench/gpu_train.py [--preset small] [--steps 30] [--sft-steps 10] [--rl-steps 2] [--tokenizer DIR]
[--out runs/gpu_train] [--activation-checkpointing]` (a prebuilt tokenizer skips the preset's tokenizer training;
RL's `--k`, `--prompts-per-family` and `--max-new-tokens` default to a short rollout batch, not the preset's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path


def _summary(stage: str, out: Path, seconds: float, skip: int) -> dict:
    import torch

    from kimi_vl.training.trainer import read_metrics

    metrics = read_metrics(out / "metrics.jsonl")
    timed = [m["step_time"] for m in metrics[skip:]] or [m["step_time"] for m in metrics]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}, *metrics], metrics)]
    per_step = statistics.median(tokens)
    row = {"stage": stage, "steps": len(metrics), "wall_s": round(seconds, 1),
           "median_step_s": round(statistics.median(timed), 4), "step_s_range": [round(min(timed), 4),
                                                                                round(max(timed), 4)],
           "tokens_per_step": per_step, "tokens_per_s": round(per_step / statistics.median(timed)),
           "loss_first": metrics[0].get("loss"), "loss_last": metrics[-1].get("loss"),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    if "reward_mean" in metrics[0]:
        row["reward_mean"] = [round(m["reward_mean"], 3) for m in metrics]
    return row


def _watch(metrics: Path, stage: str, t0: float, done: threading.Event) -> None:
    """Print a `STEP` line for each line `metrics` gains until `done` is set (the trainer appends one per step)."""
    import torch

    seen = 0
    while True:
        finished = done.wait(1.0)
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        for line in lines[seen:]:
            m = json.loads(line)
            print(f"STEP {stage} {m['step']}: {m['step_time']:.2f} s, loss {m.get('loss', float('nan')):.3f}, "
                  f"{time.perf_counter() - t0:.0f} s since the stage began, peak "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        seen = len(lines)
        if finished:
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sft-steps", type=int, default=10)
    ap.add_argument("--rl-steps", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="RL: responses per prompt")
    ap.add_argument("--prompts-per-family", type=int, default=4, help="RL: prompts of each task family per batch")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="RL: longest response")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the step time")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--out", default="runs/gpu_train")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="train every stage with it (peak memory against a run without)")
    args = ap.parse_args()

    import torch

    from kimi_vl.cli import main as kimi_vl

    if not torch.cuda.is_available():
        print("bench/gpu_train.py needs a CUDA GPU; none found.", file=sys.stderr)
        return 2
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {args.preset}", flush=True)
    root = Path(args.out)
    common = ["--preset", args.preset, "--no-progress", "--checkpoint-every", "100000",
              *(["--activation-checkpointing"] if args.activation_checkpointing else [])]
    stages = [("pretrain", args.steps, ["--tokenizer", args.tokenizer] if args.tokenizer else []),
              ("sft", args.sft_steps, ["--from", str(root / "pretrain")]),
              ("rl", args.rl_steps, ["--from", str(root / "sft"), "--k", str(args.k), "--prompts-per-family",
                                     str(args.prompts_per_family), "--max-new-tokens", str(args.max_new_tokens)])]
    rows = []
    for stage, steps, extra in stages:
        if steps == 0:  # each stage starts from the one before
            break
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(root / stage / "metrics.jsonl", stage, start, done),
                                   daemon=True)
        watcher.start()
        try:
            status = kimi_vl(["train", stage, "--out", str(root / stage), "--steps", str(steps), *common, *extra])
        except torch.OutOfMemoryError as err:  # the figure this script exists for: report it, with the peak
            print(f"SUMMARY {stage}: out of memory at {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated "
                  f"({str(err).splitlines()[0]})", flush=True)
            status = 1
        finally:
            done.set()
            watcher.join()
        if status != 0:
            print(f"SUMMARY {stage}: exit status {status}", flush=True)
            return status
        rows.append(_summary(stage, root / stage, time.perf_counter() - start, args.skip))
        print("SUMMARY " + json.dumps(rows[-1]), flush=True)
        (root / "gpu_train.json").write_text(json.dumps(rows, indent=1))  # each stage's row as it comes
    return 0


if __name__ == "__main__":
    sys.exit(main())
