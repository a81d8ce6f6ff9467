"""Is it the vision tower that does not read print? Word classification on the world's `ocr` images, no language model.

The single-word items of the world's `ocr` task (one printed capital word of 40, font size 12-22, on a plain
background: 4,068 training images of 6,000 draws, or of `--draws`; 407 validation images of 600) as a 40-way
classification, with the same optimiser (AdamW, or `--optimizer muonclip`; lr `--lr`; batches of 32) and steps for
each classifier:

- `tower`: the `tiny` preset's MoonViT-3D tower (as initialised for pre-training), its output patches mean- and
  max-pooled per image, a linear head;
- `tower, position table std 0.02`: the same with the learned position table initialised at std 0.02 instead of 1
  (the released MoonViT's from-scratch init), in case it drowns the patches;
- `patch MLP`: the processor's patches (14 x 14, or `--patch-size`) through a 2-layer MLP (width 512), pooled the
  same way: what a tower can read from a bag of patches;
- `CNN`: three 3 x 3 convolutions (32, 64, 64 channels, two 2 x 2 max-pools), global max-pool, linear head, on the
  images themselves (59K parameters, half the tower's).

Prints the training loss and validation accuracy every `--every` steps (chance 2.5%).

    python bench/ocr_tower.py --steps 600
    python bench/ocr_tower.py --steps 3000 --every 600 --classifiers tower
    python bench/ocr_tower.py --classifiers tower --patch-size 7 --max-patches 256   # 7 x 7 patches, same pixels
    python bench/ocr_tower.py --classifiers tower --optimizer muonclip --lr 3e-3       # as the quickstart trains it
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from kimi_vl.data.world import _OCR_WORDS, Sample, make_samples
from kimi_vl.training.muonclip import MuonClip
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import build_model, build_processor
from kimi_vl.vision import MoonViTImageProcessor

WORDS = list(_OCR_WORDS)


def single_words(split: str, n: int, seed: int) -> list[Sample]:
    return [s for s in make_samples(("ocr",), n, seed=seed, split=split) if " " not in s.answer]


def pooled(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """`[sum(sizes), d]` patch features -> `[len(sizes), 2d]`: each image's mean and max."""
    return torch.stack([torch.cat([c.mean(0), c.amax(0)]) for c in x.split(sizes)])


def tower_classifier(processor, pos_std: float | None) -> tuple[Callable, nn.Module]:
    torch.manual_seed(0)
    preset = get_preset("tiny")
    preset = dataclasses.replace(preset, vision={**preset.vision, "patch_size": processor.image_processor.patch_size})
    tower = build_model(preset, processor).vision_tower
    if pos_std is not None:
        nn.init.normal_(tower.patch_embed.pos_emb, std=pos_std)
    head = nn.Linear(2 * tower.config.hidden_size, len(WORDS))

    def logits(items: list[Sample]) -> torch.Tensor:
        inputs = processor.image_processor([s.image for s in items], return_tensors="pt")
        x = tower(inputs["pixel_values"], inputs["image_grid_thw"]).last_hidden_state
        return head(pooled(x, inputs["image_grid_thw"].prod(-1).tolist()))
    return logits, nn.ModuleDict({"tower": tower, "head": head})


def patch_mlp_classifier(processor, width: int = 512) -> tuple[Callable, nn.Module]:
    torch.manual_seed(0)
    p = processor.image_processor.patch_size
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * p * p, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
    head = nn.Linear(2 * width, len(WORDS))

    def logits(items: list[Sample]) -> torch.Tensor:
        inputs = processor.image_processor([s.image for s in items], return_tensors="pt")
        return head(pooled(mlp(inputs["pixel_values"]), inputs["image_grid_thw"].prod(-1).tolist()))
    return logits, nn.ModuleDict({"mlp": mlp, "head": head})


def cnn_classifier() -> tuple[Callable, nn.Module]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                        nn.Linear(64, len(WORDS)))

    def logits(items: list[Sample]) -> torch.Tensor:
        height, width = max(s.image.height for s in items), max(s.image.width for s in items)
        x = torch.ones(len(items), 3, height, width)  # white padding, in [-1, 1] as the processor scales
        for i, s in enumerate(items):
            a = torch.from_numpy(np.asarray(s.image.convert("RGB"), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
            x[i, :, :a.shape[1], :a.shape[2]] = a
        return net(x)
    return logits, net


def labels(items: list[Sample]) -> torch.Tensor:
    return torch.tensor([WORDS.index(s.answer) for s in items])


def train(name: str, logits: Callable, module: nn.Module, data: tuple[list, list], args: argparse.Namespace) -> None:
    train_items, val_items = data
    print(f"{name} ({sum(p.numel() for p in module.parameters()):,} parameters)", flush=True)
    optimizer = (MuonClip(module, args.lr, weight_decay=0.0, qk_clip_tau=None) if args.optimizer == "muonclip"
                 else torch.optim.AdamW(module.parameters(), lr=args.lr))
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = [train_items[(step * 32 + j) % len(train_items)] for j in range(32)]
        loss = nn.functional.cross_entropy(logits(batch), labels(batch))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0:
            with torch.no_grad():
                right = sum(int((logits(val_items[i:i + 50]).argmax(-1) == labels(val_items[i:i + 50])).sum())
                            for i in range(0, len(val_items), 50))
            print(f"  step {step}: training loss {loss.item():.3f}, validation accuracy "
                  f"{100 * right / len(val_items):.1f}% ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--optimizer", choices=("adamw", "muonclip"), default="adamw",
                    help="muonclip: the quickstart's optimiser (Muon on the matrices, no QK-Clip here)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draws", type=int, default=6000,
                    help="training draws of the ocr task (about two thirds are single words and kept)")
    ap.add_argument("--classifiers", nargs="+", choices=("tower", "tower-pos", "patch-mlp", "cnn"),
                    default=["tower", "tower-pos", "patch-mlp", "cnn"],
                    help="which to train (tower-pos: the tower with its position table at std 0.02)")
    ap.add_argument("--patch-size", type=int, default=14, help="the towers' and the patch MLP's patch side")
    ap.add_argument("--max-patches", type=int, default=None, help="patch budget per image (default: the preset's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    processor = build_processor(get_preset("tiny").data["pretrain"])
    processor.image_processor = MoonViTImageProcessor(
        max_patches=args.max_patches or processor.image_processor.max_patches, patch_size=args.patch_size)
    data = (single_words("train", args.draws, 1), single_words("val", 600, 2))
    print(f"{len(data[0])} training and {len(data[1])} validation images, {len(WORDS)} words, "
          f"{processor.image_processor.max_patches} patches of {args.patch_size} x {args.patch_size} per image at "
          "most\n")
    builders = {"tower": ("tower", lambda: tower_classifier(processor, None)),
                "tower-pos": ("tower, position table std 0.02", lambda: tower_classifier(processor, 0.02)),
                "patch-mlp": ("patch MLP", lambda: patch_mlp_classifier(processor)),
                "cnn": ("CNN", cnn_classifier)}
    for key in args.classifiers:
        name, build = builders[key]
        train(name, *build(), data, args)


if __name__ == "__main__":
    main()
