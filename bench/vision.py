"""MoonViT-3D forward on a mixed-resolution pack of 8 images (448-560 px), against two anchors measured here:

1. transformers' `Kimi_K25VisionModel` with the same config and weights (imported with `convert_kimi_k25_vision`):
   time ratio theirs/ours (> 1: ours is faster) and peak-memory growth of one forward, each measured in its own
   `spawn` subprocess (peak RSS), ratio theirs/ours (> 1: ours uses less);
2. our own weights run as a padded batch (every image padded to the largest, a key-padding mask, batched dense
   attention): time ratio padded/packed.

Measurements are interleaved and repeated so that load from other processes hits every side alike: `--rounds`
rounds of one timed forward each of transformers, ours and padded (ratios taken within each round), and
`--memory-rounds` rounds of the two memory subprocesses (transformers, ours); medians with [min, max] are printed.

Run: `python bench/vision.py [--rounds 5] [--memory-rounds 3]` (a few minutes on 2 CPU threads; each forward is
~300 GFLOP).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_mib, run_isolated, spread  # noqa: E402

THREADS = 2
VISION = dict(hidden_size=384, num_attention_heads=6, num_hidden_layers=6, intermediate_size=1536,
              pos_emb_height=32, pos_emb_width=32)
# (t, h, w) in 14-px patches: 448x448 (x4), 448x560, 560x448, 504x504, 560x560
GRIDS = [[1, 32, 32], [1, 32, 32], [1, 32, 32], [1, 32, 32], [1, 32, 40], [1, 40, 32], [1, 36, 36], [1, 40, 40]]


def build_checkpoints(root: Path) -> tuple[Path, Path]:
    """A random transformers vision tower saved to `root/hf`, converted to `root/ours`."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    from kimi_vl.vision.convert import convert_kimi_k25_vision

    torch.manual_seed(0)
    model = Kimi_K25VisionModel(Kimi_K25VisionConfig(**VISION))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1 and "position" not in name:
                p.normal_(0, p[0].numel() ** -0.5)
    model.save_pretrained(root / "hf")
    return root / "hf", convert_kimi_k25_vision(root / "hf", root / "ours")


def load(kind: str, path: Path) -> torch.nn.Module:
    if kind == "theirs":
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

        model = Kimi_K25VisionModel.from_pretrained(path, attn_implementation="sdpa")
    else:
        from kimi_vl.vision import MoonViTModel

        model = MoonViTModel.from_pretrained(path)
    return model.eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(1)), torch.tensor(GRIDS)


def forward(model: torch.nn.Module, kind: str, px: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(px, grid_thw=grid).pooler_output if kind == "theirs" else model(px, grid).pooler_output


def padded_forward(model, px: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Our weights, every image padded to the largest: `[B, L_max, D]` with a key-padding mask."""
    from kimi_vl.vision.moonvit import build_layout, split_chunks

    with torch.no_grad():
        layout = build_layout(split_chunks(grid, model.config.temporal_chunk_size), px.device)
        x = model.patch_embed(px, layout)
        sin, cos = model.rotary_emb(layout)
        lengths = grid.prod(-1).tolist()
        longest = max(lengths)
        valid = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]  # [B, L_max]

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.stack([F.pad(s, (0, 0) * (t.dim() - 1) + (0, longest - len(s))) for s in t.split(lengths)])

        x, sin, cos = pad(x), pad(sin), pad(cos)
        mask = valid[:, None, None, :]
        heads, head_dim = model.config.num_attention_heads, model.config.head_dim
        for layer in model.layers:
            h = layer.norm1(x)
            q, k, v = layer.attn.qkv(h).view(*h.shape[:2], 3, heads, head_dim).unbind(2)
            q, k = apply_rot_embed(q, sin, cos, half=True), apply_rot_embed(k, sin, cos, half=True)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
            x = x + layer.attn.proj(o.transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.norm2(x))
        x = model.final_layernorm(x)[valid]
        return model.merge(x, layout.chunks)


def memory_target(kind: str, path: str, queue) -> None:
    """In a fresh process: peak-RSS growth (MiB) of one forward, after the model and inputs exist."""
    torch.set_num_threads(THREADS)
    model = load(kind, Path(path))
    px, grid = inputs()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the forward's pages count as growth
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) left by imports and loading
    before = peak_rss_mib()
    forward(model, kind, px, grid)
    queue.put({"growth_mib": peak_rss_mib() - before})



def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        hf_path, our_path = build_checkpoints(Path(tmp))
        # Memory first, each forward in its own process (its own peak, not this larger process's: `peak_rss_mib`).
        memory: dict[str, list[float]] = {"theirs": [], "ours": []}
        for _ in range(args.memory_rounds):
            for kind, path in (("theirs", hf_path), ("ours", our_path)):
                memory[kind].append(run_isolated(memory_target, kind, str(path))["growth_mib"])
        theirs, ours = load("theirs", hf_path), load("ours", our_path)
        px, grid = inputs()
        tokens = px.shape[0]
        a, b = forward(theirs, "theirs", px, grid), forward(ours, "ours", px, grid)  # these double as warm-up
        c = padded_forward(ours, px, grid)
        print(f"pack: {len(GRIDS)} images, {tokens} patches, hidden {VISION['hidden_size']}, "
              f"{VISION['num_hidden_layers']} layers, {THREADS} threads")
        print(f"max |ours - transformers| = {(a - b).abs().max():.2e}, "
              f"max |padded - packed| = {(c - b).abs().max():.2e}")

        times: dict[str, list[float]] = {"theirs": [], "ours": [], "padded": []}
        for _ in range(args.rounds):  # interleaved: one forward of each per round
            times["theirs"].append(timed(lambda: forward(theirs, "theirs", px, grid)))
            times["ours"].append(timed(lambda: forward(ours, "ours", px, grid)))
            times["padded"].append(timed(lambda: padded_forward(ours, px, grid)))
    speed = [t / o for t, o in zip(times["theirs"], times["ours"])]
    padded = [p / o for p, o in zip(times["padded"], times["ours"])]
    mem = [t / max(o, 1e-6) for t, o in zip(memory["theirs"], memory["ours"])]
    print(f"forward seconds: transformers {spread(times['theirs'])}, ours {spread(times['ours'])}, "
          f"padded {spread(times['padded'])} ({args.rounds} interleaved rounds)")
    print(f"time ratio transformers/ours = {spread(speed)}")
    print(f"time ratio padded/packed     = {spread(padded)}")
    print(f"peak-memory growth of one forward: transformers {spread(memory['theirs'])} MiB, ours "
          f"{spread(memory['ours'])} MiB (ratio transformers/ours = {spread(mem)}; {args.memory_rounds} rounds)")
    print(f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"SUMMARY vision: speed transformers/ours {spread(speed)}x, padded/packed {spread(padded)}x, peak memory "
          f"transformers/ours {spread(mem)}x (median [min, max])")


if __name__ == "__main__":
    main()
