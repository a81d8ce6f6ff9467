"""Cost of Attention Residuals: training-step time and peak memory of `block_attnres` and full `attnres`
against the standard residual, same tiny model (hidden 256, 8 layers in the 3:1 hybrid, 8 experts top-2,
batch 4 x 512, fp32, CPU). Each variant runs in its own subprocess (peak memory = peak-RSS growth over the
first training step; time = the median of `--steps` steps after it), the three one after the other in each of
`--rounds` rounds, so a drift of the machine's pace reaches every variant alike. Prints each round's ratios against
the standard residual and their median [min, max] (target: block_attnres time overhead <= 10%).

    python bench/attnres.py [--threads 2] [--steps 3] [--block 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

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
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    variants = ("standard", "block_attnres", "attnres")
    ratios: dict[tuple[str, str], list[float]] = {(v, k): [] for v in variants[1:] for k in ("time", "peak")}
    for n in range(args.rounds):
        res = {r: run_isolated(_worker, r, args) for r in variants}
        std = res["standard"]
        print(f"round {n + 1}: " + "; ".join(f"{name} {r['time'] * 1e3:.1f} ms, peak +{r['peak']:.1f} MiB"
                                           for name, r in res.items()))
        for (v, k), values in ratios.items():
            values.append(res[v][k] / std[k])

    def summary(v: str, k: str) -> str:
        values = ratios[v, k]
        return f"{statistics.median(values):.3f}x [{min(values):.3f}, {max(values):.3f}]"

    print(f"RATIO (median [min, max] over {args.rounds} rounds) block_attnres/standard: time "
          f"{summary('block_attnres', 'time')} (target <= 1.10x), memory {summary('block_attnres', 'peak')}; "
          f"full attnres/standard: time {summary('attnres', 'time')}, memory {summary('attnres', 'peak')}")


if __name__ == "__main__":
    main()
