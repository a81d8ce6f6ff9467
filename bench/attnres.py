"""Cost of Attention Residuals: training-step time and peak memory of `block_attnres` and full `attnres`
against the standard residual, same tiny model (hidden 256, 8 layers in the 3:1 hybrid, 8 experts top-2,
batch 4 x 512, fp32, CPU). Each variant runs in its own subprocess (peak memory = `ru_maxrss` growth over the
first training step). Prints both ratios (target: block_attnres time overhead <= 10%).

    python bench/attnres.py [--threads 2] [--steps 3] [--block 6]
"""

from __future__ import annotations

import argparse

import torch
from common import TINY_TEXT, median_time, peak_rss_mib, run_isolated

from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM


def _worker(residual: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = KimiTextConfig(residual=residual, attnres_block_size=args.block, **TINY_TEXT)
    model = KimiTextForCausalLM(cfg).train()
    ids = torch.randint(3, TINY_TEXT["vocab_size"], (args.batch, args.seq))

    def step() -> None:
        model(ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    base = peak_rss_mib()
    step()
    peak = peak_rss_mib() - base
    queue.put(dict(time=median_time(step, args.steps, warmup=0), peak=peak))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--block", type=int, default=6, help="attnres_block_size for block_attnres (sublayers)")
    args = ap.parse_args()
    res = {r: run_isolated(_worker, r, args) for r in ("standard", "block_attnres", "attnres")}
    std = res["standard"]
    for name, r in res.items():
        print(f"{name:14s} step {r['time'] * 1e3:8.1f} ms   peak +{r['peak']:7.1f} MiB   "
              f"time x{r['time'] / std['time']:.3f}   memory x{r['peak'] / std['peak']:.3f}")
    b, f = res["block_attnres"], res["attnres"]
    print(f"RATIO block_attnres/standard: time {b['time'] / std['time']:.3f}x (target <= 1.10x), "
          f"memory {b['peak'] / std['peak']:.3f}x; full attnres/standard: time {f['time'] / std['time']:.3f}x, "
          f"memory {f['peak'] / std['peak']:.3f}x")


if __name__ == "__main__":
    main()
