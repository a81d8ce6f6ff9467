"""Long-context decode throughput: the 3:1 KDA/MLA hybrid against an all-MLA model of the same sizes.

At each context length (default 16K, 128K and 1M tokens) both models get a cache in the state a prefill of that
many tokens leaves, filled with random values instead of running the prefill (`KimiHybridCache.random`: KDA
recurrent and conv states, MLA latents and rope keys for every position, allocated once with room for the decoded
tokens). Decoding then runs the models' own forward with that cache, the code `generate` runs per new token (greedy,
batch 1, fp32, CPU). The two models' decode steps are interleaved: each round times `--tokens` steps of the hybrid,
then of all-MLA; the table gives the median tokens/s over `--rounds` rounds with the [min, max] spread, the ratio
(median of the per-round ratios, with spread), the cache bytes per token and the ceiling of the ratio for the
layout: all-MLA's attention cost over the hybrid's (bytes of cache each decode step reads; 4x for 3:1 once the
MLA latents dominate).

    python bench/decode.py [--contexts 16384,131072,1048576] [--tokens 4] [--rounds 7] [--threads 2]

The all-MLA cache at 1M tokens takes 5.0 GiB (8 layers x 160 fp32 values per token), the hybrid's 1.3 GiB.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import TINY_TEXT, peak_rss_mib, spread

from kimi_vl.text import KimiHybridCache, KimiTextConfig, KimiTextForCausalLM


def attention_bytes(config: KimiTextConfig, context: int) -> int:
    """Cache bytes one decode step reads at `context` tokens (fp32): every MLA layer's latents, every KDA layer's
    recurrent state and conv tail."""
    kda = config.kda_num_heads * config.kda_head_dim * (config.kda_head_dim + 3 * (config.short_conv_kernel_size - 1))
    mla = context * (config.kv_lora_rank + config.qk_rope_head_dim)
    return 4 * sum(kda if kind == "kda" else mla for kind in config.layer_types)



@torch.no_grad()
def decode_steps(model: KimiTextForCausalLM, cache: KimiHybridCache, token: torch.Tensor, n: int) -> float:
    """Seconds per token of `n` greedy decode steps (each feeds back its argmax)."""
    t0 = time.perf_counter()
    for _ in range(n):
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="16384,131072,1048576")
    ap.add_argument("--tokens", type=int, default=4, help="decode steps per model per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {name: KimiTextForCausalLM(KimiTextConfig(layer_types=layers, **TINY_TEXT)).eval()
              for name, layers in [("hybrid", None), ("all-MLA", ["mla"] * TINY_TEXT["num_hidden_layers"])]}
    hybrid_cfg, mla_cfg = models["hybrid"].config, models["all-MLA"].config
    layout = mla_cfg.layer_types.count("mla") / hybrid_cfg.layer_types.count("mla")
    print(f"tiny shape (hidden {TINY_TEXT['hidden_size']}, {TINY_TEXT['num_hidden_layers']} layers; hybrid "
          f"{''.join(k[0].upper() for k in hybrid_cfg.layer_types)}), batch 1, fp32, {args.threads} threads, "
          f"{args.rounds} rounds x {args.tokens} tokens per model, interleaved; layout ceiling {layout:.0f}x")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        load_before = os.getloadavg()[0]
        caches = {name: KimiHybridCache.random(m.config, context, max_length=context + (args.rounds + 1) * args.tokens,
                                               generator=torch.Generator().manual_seed(1))
                  for name, m in models.items()}
        token = torch.tensor([[3]])
        for name, m in models.items():  # warm-up
            decode_steps(m, caches[name], token, args.tokens)
        rates: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, m in models.items():
                rates[name].append(1 / decode_steps(m, caches[name], token, args.tokens))
        ratios = [h / a for h, a in zip(rates["hybrid"], rates["all-MLA"])]
        per_token = {name: c.nbytes() / c.get_seq_length() for name, c in caches.items()}
        ceiling = attention_bytes(mla_cfg, context) / attention_bytes(hybrid_cfg, context)
        rows.append((context, rates, ratios, per_token, ceiling, load_before, os.getloadavg()[0]))
        del caches
        print(f"context {context:>8}: hybrid {spread(rates['hybrid'])} tok/s, all-MLA {spread(rates['all-MLA'])} "
              f"tok/s, ratio {spread(ratios)}x (ceiling {ceiling:.2f}x); cache {per_token['hybrid']:.0f} vs "
              f"{per_token['all-MLA']:.0f} B/token ({per_token['hybrid'] / per_token['all-MLA']:.3f}x); load "
              f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\npeak RSS {peak_rss_mib() / 1024:.1f} GiB")
    print("| context | hybrid tok/s median [min, max] | all-MLA tok/s median [min, max] | ratio median [min, max] "
          "| ceiling | cache B/token hybrid / all-MLA | load avg before -> after |")
    print("|---|---|---|---|---|---|---|")
    for context, rates, ratios, per_token, ceiling, before, after in rows:
        print(f"| {context:,} | {spread(rates['hybrid'])} | {spread(rates['all-MLA'])} | {spread(ratios)}x "
              f"| {ceiling:.2f}x | {per_token['hybrid']:.0f} / {per_token['all-MLA']:.0f} "
              f"({per_token['hybrid'] / per_token['all-MLA']:.3f}x) | {before:.2f} -> {after:.2f} |")
    for context, _, ratios, *_ in rows:
        print(f"RATIO decode tokens/s hybrid/all-MLA at {context:,} = {spread(ratios, 'x')}")


if __name__ == "__main__":
    main()
