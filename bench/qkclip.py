"""QK-Clip in the logit-explosion setting: max pre-softmax logit over training steps, with and without QK-Clip.

Two small attention models are trained with MuonClip at a high learning rate and no weight decay on key-value
retrieval (8 tokens `key * 8 + value` with distinct keys, then a query token naming one key; the answer is its
value). Solving it rewards ever sharper attention, so without QK-Clip the max logit keeps growing; with it, each
step's recorded max (before clipping) should stay near tau. Models:

- `mla`: `KimiTextForCausalLM` with all-MLA layers (QK-Clip's MLA rule: q_nope, k_nope by sqrt(gamma), q_pe by gamma);
- `mha`: an embedding + MoonViT encoder blocks (fused qkv with bias, 2-D RoPE, packed attention) + a head on the
  query token (the MHA rule on the fused qkv weight and bias).

Both runs of a model see the same initial weights and batches. Prints the max logit every few steps, the final
max / tau ratios (the anchor is tau itself) and the losses, and saves the curves to bench/out/qkclip.png.

    python bench/qkclip.py [--steps 300] [--lr 0.02] [--tau 30] [--batch 256] [--models mla mha]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kimi_vl.optim_contract import ADAMW
from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.training import MuonClip
from kimi_vl.vision import MoonViTConfig
from kimi_vl.vision.moonvit import MoonViTBlock, MoonViTRotaryEmbedding, build_layout

KEYS = VALUES = PAIRS = 8
VOCAB = KEYS * VALUES + KEYS + VALUES  # pair tokens, query tokens, answer tokens


def retrieval_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids [n, PAIRS + 1]` (pairs, then the query token) and `answers [n]` (answer token ids)."""
    keys = torch.argsort(torch.rand(n, KEYS, generator=gen), 1)[:, :PAIRS]
    values = torch.randint(0, VALUES, (n, PAIRS), generator=gen)
    pick = torch.randint(0, PAIRS, (n,), generator=gen)
    rows = torch.arange(n)
    query = KEYS * VALUES + keys[rows, pick]
    answers = KEYS * VALUES + KEYS + values[rows, pick]
    return torch.cat([keys * VALUES + values, query[:, None]], 1), answers


class MLARetriever(nn.Module):
    """All-MLA Kimi text model; the loss is the next-token cross-entropy of the answer after the query."""

    def __init__(self, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        cfg = KimiTextConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            layer_types=["mla"] * layers, num_attention_heads=heads, kv_lora_rank=hidden // 2, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, first_k_dense=layers, residual="standard", num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, kda_num_heads=heads, kda_head_dim=8,
            pad_token_id=None, bos_token_id=None, eos_token_id=None,
        )
        self.lm = KimiTextForCausalLM(cfg)

    def forward(self, ids: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(ids).logits[:, -1].float(), answers)


class MHARetriever(nn.Module):
    """Token embedding + MoonViT blocks over each sample as its own packed segment + a head on the query token."""

    optimizer_routes = {"lm_head": ADAMW}  # the head goes to AdamW, like an LM head

    def __init__(self, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        cfg = MoonViTConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                            intermediate_size=2 * hidden, pos_emb_height=8, pos_emb_width=8)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(MoonViTBlock(cfg) for _ in range(layers))
        self.rotary = MoonViTRotaryEmbedding(cfg)
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        layout = build_layout([(1, 1, T)] * B, ids.device)
        rope = self.rotary(layout)
        x = self.embed(ids).flatten(0, 1)
        for block in self.blocks:
            x = block(x, layout.cu_seqlens, rope)
        return F.cross_entropy(self.lm_head(self.norm(x).view(B, T, -1)[:, -1]), answers)


MODELS = {"mla": MLARetriever, "mha": MHARetriever}


def train(kind: str, tau: float | None, args) -> dict[str, list[float]]:
    """Per step: the max over heads of the recorded max logit (before clipping), the fraction of heads clipped
    and the loss. `tau=None`: QK-Clip off (maxima still recorded, tau infinite)."""
    torch.manual_seed(args.seed)
    model = MODELS[kind](args.hidden, args.layers, args.heads).train()
    opt = MuonClip(model, lr=args.lr, weight_decay=0.0, qk_clip_tau=math.inf if tau is None else tau)
    gen = torch.Generator().manual_seed(args.seed)
    out: dict[str, list[float]] = {"max": [], "clipped": [], "loss": []}
    for _ in range(args.steps):
        loss = model(*retrieval_batch(args.batch, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        maxima = torch.cat(list(opt.last_max_logits.values()))
        out["max"].append(float(maxima.max()))
        out["clipped"].append(float((maxima > args.tau).float().mean()))
        out["loss"].append(loss.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--tau", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mla", "mha"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "qkclip.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results = {}
    for kind in args.models:
        t0 = time.perf_counter()
        free, clipped = train(kind, None, args), train(kind, args.tau, args)
        results[kind] = (free, clipped)
        first = next((i for i, m in enumerate(clipped["max"]) if m > args.tau), None)
        every = max(1, args.steps // 15)
        print(f"\n== {kind}: lr {args.lr}, tau {args.tau}, batch {args.batch}, {args.steps} steps "
              f"({time.perf_counter() - t0:.0f} s)")
        print(f"{'step':>6} {'max logit, no clip':>19} {'with QK-Clip':>13} {'heads clipped':>14}")
        for i in sorted({*range(0, args.steps, every), args.steps - 1}):  # the last step once
            print(f"{i:>6} {free['max'][i]:>19.2f} {clipped['max'][i]:>13.2f} {clipped['clipped'][i]:>14.2f}")
        print(f"final max / tau: no clip {free['max'][-1] / args.tau:.2f}, with QK-Clip "
              f"{clipped['max'][-1] / args.tau:.3f}")
        if first is None:
            print("the max logit never passed tau: raise --lr or --steps, or lower --tau")
        else:
            after = clipped["max"][first:]
            print(f"first step above tau: {first}; after it, max / tau with QK-Clip {max(after) / args.tau:.3f}, "
                  f"mean {sum(after) / len(after) / args.tau:.3f}")
        tail = max(1, args.steps // 10)
        print(f"mean loss over the last {tail} steps: no clip {sum(free['loss'][-tail:]) / tail:.4f}, "
              f"with QK-Clip {sum(clipped['loss'][-tail:]) / tail:.4f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (kind, (free, clipped)) in zip(axes[0], results.items()):
        ax.plot(free["max"], label="MuonClip without QK-Clip")
        ax.plot(clipped["max"], label="with QK-Clip")
        ax.axhline(args.tau, color="grey", linestyle="--", linewidth=1, label=f"tau = {args.tau:g}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("max pre-softmax logit (before clipping)")
        ax.set_title(f"{kind.upper()}: lr {args.lr:g}, no weight decay, key-value retrieval")
        ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
