"""Decode throughput at long context: the 3:1 KDA/MLA hybrid against an all-MLA model of the same sizes.

Both models are prefilled with the same `--context` tokens (default 16K), then decode `--tokens` tokens one at a
time with the cache (greedy, batch 1, fp32, CPU). Prints tokens/s of each, the ratio hybrid/all-MLA (target
>= 2x) and the cache bytes per token of each.

    python bench/decode.py [--context 16384] [--tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import TINY_TEXT

from kimi_vl.text import KimiHybridCache, KimiTextConfig, KimiTextForCausalLM


@torch.inference_mode()
def decode_rate(model: KimiTextForCausalLM, context: torch.Tensor, tokens: int) -> tuple[float, int]:
    cache = KimiHybridCache(model.config)
    logits = model(context, past_key_values=cache, logits_to_keep=1).logits
    nxt = logits[:, -1:].argmax(-1)
    model(nxt, past_key_values=cache)  # warm-up step
    t0 = time.perf_counter()
    for _ in range(tokens):
        nxt = model(nxt, past_key_values=cache).logits[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - t0), cache.nbytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    context = torch.randint(3, TINY_TEXT["vocab_size"], (1, args.context))
    results = {}
    for name, layer_types in [("hybrid 3:1", None), ("all-MLA", ["mla"] * TINY_TEXT["num_hidden_layers"])]:
        model = KimiTextForCausalLM(KimiTextConfig(layer_types=layer_types, **TINY_TEXT)).eval()
        rate, nbytes = decode_rate(model, context, args.tokens)
        results[name] = rate
        print(f"{name:10s}: {rate:8.1f} tokens/s at {args.context} context, cache {nbytes / 2**20:.1f} MiB "
              f"({nbytes / (args.context + args.tokens + 1):.0f} B/token)")
    print(f"RATIO decode tokens/s hybrid/all-MLA = {results['hybrid 3:1'] / results['all-MLA']:.2f}x "
          "(target >= 2x)")


if __name__ == "__main__":
    main()
