"""Does Block AttnRes help at tiny scale? Train the same tiny byte-level LM with the standard residual and with
`block_attnres` for a fixed token budget on real text (the running Python's standard-library sources), over
several seeds, and print the validation-loss difference with its spread. Reports whatever sign it measures.

    python bench/attnres_loss.py [--steps 300] [--seeds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's `.py` sources (sorted paths), concatenated as bytes, at most `limit` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def train(residual: str, seed: int, data: torch.Tensor, val: torch.Tensor, args) -> float:
    torch.manual_seed(seed)
    cfg = KimiTextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, moe_intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        kda_head_dim=32, kda_num_heads=4, num_experts=4, num_experts_per_tok=2, residual=residual,
        attnres_block_size=args.block, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    model = KimiTextForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to 0
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        model(batch, labels=batch, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.model.update_router_biases(1e-3)
    model.eval()
    with torch.no_grad():
        rows = val[: len(val) // args.seq * args.seq].view(-1, args.seq)[:32]
        return model(rows, labels=rows, use_cache=False).loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--block", type=int, default=4, help="attnres_block_size (sublayers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = stdlib_bytes(4_000_000)
    split = int(0.95 * len(text))
    data, val = text[:split], text[split:]
    print(f"{len(data):,} training bytes, {args.steps} steps x {args.batch} x {args.seq} = "
          f"{args.steps * args.batch * args.seq:,} tokens per run")
    losses: dict[str, list[float]] = {"standard": [], "block_attnres": []}
    for seed in range(args.seeds):
        for residual in losses:
            t0 = time.perf_counter()
            losses[residual].append(train(residual, seed, data, val, args))
            print(f"seed {seed} {residual:13s} val loss {losses[residual][-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    diffs = [b - s for s, b in zip(losses["standard"], losses["block_attnres"])]
    spread = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    print(f"RESULT val loss block_attnres - standard = {statistics.mean(diffs):+.4f} "
          f"(std over {len(diffs)} seeds {spread:.4f}; per seed {', '.join(f'{d:+.4f}' for d in diffs)})")


if __name__ == "__main__":
    main()
