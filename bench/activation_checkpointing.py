"""What activation checkpointing (`--activation-checkpointing`, `TrainConfig.activation_checkpointing`) buys and
costs: a training forward + backward of the same model with and without it (hidden 256, 8 layers in the 3:1 hybrid
with Block AttnRes, 8 experts top-2; packed rows of `--docs` documents, `--batch` x `--seq` tokens, fp32, CPU). Each
variant runs in its own subprocess (peak memory = peak-RSS growth over the first step: activations, gradients and
the allocator's caches; time = the median of `--steps` steps after it), both in each of `--rounds` rounds, so a
drift of the machine's pace reaches both alike. Also checks that both give the same gradients, bit for bit. Prints
each round and the ratios (with / without) as median [min, max].

    python bench/activation_checkpointing.py [--threads 2] [--batch 1] [--seq 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from common import TINY_TEXT, median_time, peak_rss_mib, run_isolated, spread

from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM


def _worker(checkpointing: bool, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = KimiTextForCausalLM(KimiTextConfig(residual="block_attnres", **TINY_TEXT)).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    ids = torch.randint(3, TINY_TEXT["vocab_size"], (args.batch, args.seq))
    bounds = torch.linspace(0, args.seq, args.docs + 1).round().int()  # one packed row of `docs` documents
    kwargs = dict(cu_seqlens=bounds) if args.batch == 1 else {}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False, **kwargs).loss.backward()

    base = peak_rss_mib()
    step()
    peak = peak_rss_mib() - base
    digest = hashlib.sha256()  # every gradient's bytes, in parameter order: equal digests = bit-identical
    for name, p in model.named_parameters():
        digest.update(name.encode() + (b"" if p.grad is None else p.grad.numpy().tobytes()))
    queue.put(dict(time=median_time(step, args.steps, warmup=0), peak=peak, grad=digest.hexdigest()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=8, help="documents packed in the row (batch 1)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ratios: dict[str, list[float]] = {"time": [], "peak": []}
    for n in range(args.rounds):
        off, on = (run_isolated(_worker, c, args) for c in (False, True))
        print(f"round {n + 1}: without {off['time']:.2f} s, peak +{off['peak']:.0f} MiB; "
              f"with {on['time']:.2f} s, peak +{on['peak']:.0f} MiB; same gradients: {on['grad'] == off['grad']}")
        for k in ratios:
            ratios[k].append(on[k] / off[k])
    print(f"RATIO with / without activation checkpointing ({args.batch} x {args.seq} tokens, median [min, max] over "
          f"{args.rounds} rounds): step time {spread(ratios['time'], 'x')}, peak memory {spread(ratios['peak'], 'x')}")


if __name__ == "__main__":
    main()
