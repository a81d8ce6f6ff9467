"""Is it the vision tower that does not read print? Printed words and bar charts read with no language model.

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
- `CNN`: three 3 x 3 convolutions (32, 64, 64 channels, two 2 x 2 max-pools) on the images themselves, its
  positions pooled the same way.

With `--task chart_bar` the images are the world's bar charts (3-5 bars, each value 1-20 printed above its bar in a
10-pixel font, a town's three-letter name under it) and each classifier reads every bar's value and label: ten
learned queries (five for the values, five for the labels, left to right) attend over the image's patches
(positions), each followed by a 21-way linear layer (a value or a town, or no bar); accuracy counts the bars present
(chance 5% for a value, about 10% for a label). `--task chart_values` reads the values only (five queries).
`--task count` reads how many objects the world's counting scenes hold (1-6, one query; chance 1/6).

Prints the training loss and validation accuracy every `--every` steps (chance 2.5% for ocr).

    python bench/ocr_tower.py --steps 600
    python bench/ocr_tower.py --steps 3000 --every 600 --classifiers tower
    python bench/ocr_tower.py --classifiers tower --patch-size 7 --max-patches 256   # 7 x 7 patches, same pixels
    python bench/ocr_tower.py --classifiers tower --optimizer muonclip --lr 3e-3       # as the quickstart trains it
    python bench/ocr_tower.py --classifiers tower --draws 60000 --steps 5000 --every 1000 --save runs/ocr/tower.pt
    python bench/ocr_tower.py --task chart_values --classifiers tower --draws 60000 --steps 5000 --every 500 \
        --save runs/ocr/tower_chart_values.pt
    python bench/ocr_tower.py --task chart_bar --classifiers tower --draws 60000 --steps 4000 --every 500
    python bench/ocr_tower.py --task count --classifiers tower cnn --draws 20000 --steps 1000 --every 100

`--save` writes the trained tower's weights (the `tower` classifier's, without its head) for
`bench/vision_ratio.py --tower`: a stand-in for K2.5's ViT-training stage before joint pre-training.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from kimi_vl.data.world import _OCR_WORDS, TOWNS, Sample, make_samples
from kimi_vl.training.muonclip import MuonClip
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import build_model, build_processor
from kimi_vl.vision import MoonViTImageProcessor

WORDS = list(_OCR_WORDS)


def single_words(split: str, n: int, seed: int) -> list[Sample]:
    return [s for s in make_samples(("ocr",), n, seed=seed, split=split) if " " not in s.answer]


def bar_charts(split: str, n: int, seed: int) -> list[Sample]:
    return make_samples(("chart_bar",), n, seed=seed, split=split)


def scenes(split: str, n: int, seed: int) -> list[Sample]:
    return make_samples(("count",), n, seed=seed, split=split)


def pooled(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """`[sum(sizes), d]` patch features -> `[len(sizes), 2d]`: each image's mean and max."""
    return torch.stack([torch.cat([c.mean(0), c.amax(0)]) for c in x.split(sizes)])


class PooledHead(nn.Module):
    """`[sum(sizes), d]` patch features -> `[len(sizes), 1, classes]`: a linear layer on each image's mean and max."""

    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * d, classes)

    def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self.linear(pooled(x, sizes))[:, None]


class SlotHead(nn.Module):
    """`[sum(sizes), d]` patch features -> `[len(sizes), slots, classes]`: one learned query per slot (bar) attends
    over each image's patches, and a linear layer reads its class from what it gathered."""

    def __init__(self, d: int, slots: int, classes: int) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(slots, d) / d ** 0.5)
        self.key = nn.Linear(d, d)
        self.linear = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.stack([self.linear((self.queries @ self.key(c).T / c.shape[-1] ** 0.5).softmax(-1) @ c)
                            for c in x.split(sizes)])


@dataclasses.dataclass(frozen=True)
class Task:
    """What is read off the images: `items(split, n, seed)`, their integer `targets` (`[B, slots]`), the `head` that
    reads them from `[sum(sizes), d]` features, and the `parts` the slots split into (equal spans, each scored on
    its own where `scored(targets)`)."""
    items: Callable[[str, int, int], list[Sample]]
    targets: Callable[[list[Sample]], torch.Tensor]
    head: Callable[[int], nn.Module]
    parts: tuple[str, ...]
    scored: Callable[[torch.Tensor], torch.Tensor]


BAR_SLOTS, BAR_VALUES = 5, 20


def bar_targets(items: list[Sample], labels: bool) -> torch.Tensor:
    """`[B, BAR_SLOTS]`: each bar's value (1-20), left to right, 0 where there is no bar; with `labels`, then as many
    slots for the bars' labels (1 + the town's index in `TOWNS`): `[B, 2 * BAR_SLOTS]`."""
    def slots(xs: list[int]) -> list[int]:
        return (xs + [0] * BAR_SLOTS)[:BAR_SLOTS]
    return torch.tensor([slots(s.meta["values"]) + (slots([TOWNS.index(t) + 1 for t in s.meta["labels"]])
                                                    if labels else []) for s in items])


TASKS = {
    "count": Task(scenes, lambda items: torch.tensor([[int(s.answer) - 1] for s in items]),
                  lambda d: SlotHead(d, 1, 6), ("counts",), lambda t: torch.ones_like(t, dtype=torch.bool)),
    "ocr": Task(single_words, lambda items: torch.tensor([[WORDS.index(s.answer)] for s in items]),
                lambda d: PooledHead(d, len(WORDS)), ("words",), lambda t: torch.ones_like(t, dtype=torch.bool)),
    "chart_values": Task(bar_charts, lambda items: bar_targets(items, labels=False),
                         lambda d: SlotHead(d, BAR_SLOTS, BAR_VALUES + 1), ("bar values",), lambda t: t > 0),
    "chart_bar": Task(bar_charts, lambda items: bar_targets(items, labels=True),
                      lambda d: SlotHead(d, 2 * BAR_SLOTS, max(BAR_VALUES, len(TOWNS)) + 1),
                      ("bar values", "bar labels"), lambda t: t > 0),
}


def tower_classifier(processor, task: Task, pos_std: float | None) -> tuple[Callable, nn.Module]:
    torch.manual_seed(0)
    preset = get_preset("tiny")
    preset = dataclasses.replace(preset, vision={**preset.vision, "patch_size": processor.image_processor.patch_size})
    tower = build_model(preset, processor).vision_tower
    if pos_std is not None:
        nn.init.normal_(tower.patch_embed.pos_emb, std=pos_std)
    head = task.head(tower.config.hidden_size)

    def logits(items: list[Sample]) -> torch.Tensor:
        inputs = processor.image_processor([s.image for s in items], return_tensors="pt")
        x = tower(inputs["pixel_values"], inputs["image_grid_thw"]).last_hidden_state
        return head(x, inputs["image_grid_thw"].prod(-1).tolist())
    return logits, nn.ModuleDict({"tower": tower, "head": head})


def patch_mlp_classifier(processor, task: Task, width: int = 512) -> tuple[Callable, nn.Module]:
    torch.manual_seed(0)
    p = processor.image_processor.patch_size
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * p * p, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
    head = task.head(width)

    def logits(items: list[Sample]) -> torch.Tensor:
        inputs = processor.image_processor([s.image for s in items], return_tensors="pt")
        return head(mlp(inputs["pixel_values"]), inputs["image_grid_thw"].prod(-1).tolist())
    return logits, nn.ModuleDict({"mlp": mlp, "head": head})


def cnn_classifier(task: Task) -> tuple[Callable, nn.Module]:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
    head = task.head(64)

    def logits(items: list[Sample]) -> torch.Tensor:
        height, width = max(s.image.height for s in items), max(s.image.width for s in items)
        x = torch.ones(len(items), 3, height, width)  # white padding, in [-1, 1] as the processor scales
        for i, s in enumerate(items):
            a = torch.from_numpy(np.asarray(s.image.convert("RGB"), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
            x[i, :, :a.shape[1], :a.shape[2]] = a
        f = features(x)  # [B, 64, H/4, W/4]
        return head(f.flatten(2).transpose(1, 2).reshape(-1, 64), [f.shape[2] * f.shape[3]] * len(items))
    return logits, nn.ModuleDict({"features": features, "head": head})


def train(name: str, logits: Callable, module: nn.Module, task: Task, data: tuple[list, list],
          args: argparse.Namespace) -> None:
    train_items, val_items = data
    print(f"{name} ({sum(p.numel() for p in module.parameters()):,} parameters)", flush=True)
    optimizer = (MuonClip(module, args.lr, weight_decay=0.0, qk_clip_tau=None) if args.optimizer == "muonclip"
                 else torch.optim.AdamW(module.parameters(), lr=args.lr))
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = [train_items[(step * 32 + j) % len(train_items)] for j in range(32)]
        out = logits(batch)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), task.targets(batch).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0:
            with torch.no_grad():
                chunks = [val_items[i:i + 50] for i in range(0, len(val_items), 50)]
                targets = torch.cat([task.targets(c) for c in chunks])
                right, scored = torch.cat([logits(c).argmax(-1) for c in chunks]) == targets, task.scored(targets)
            accuracies = ", ".join(f"{name} {100 * float((r & m).sum() / m.sum()):.1f}%" for name, r, m in zip(
                task.parts, right.chunk(len(task.parts), -1), scored.chunk(len(task.parts), -1)))
            print(f"  step {step}: training loss {loss.item():.3f}, validation accuracy {accuracies} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--optimizer", choices=("adamw", "muonclip"), default="adamw",
                    help="muonclip: the quickstart's optimiser (Muon on the matrices, no QK-Clip here)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--task", choices=tuple(TASKS), default="ocr",
                    help="ocr: which of 40 words; chart_bar: the value (1-20) and the label of each bar of the world's "
                         "bar charts; chart_values: the values only; count: how many objects (1-6) a scene holds")
    ap.add_argument("--draws", type=int, default=6000,
                    help="training draws of the task (of ocr's, about two thirds are single words and kept)")
    ap.add_argument("--classifiers", nargs="+", choices=("tower", "tower-pos", "patch-mlp", "cnn"),
                    default=["tower", "tower-pos", "patch-mlp", "cnn"],
                    help="which to train (tower-pos: the tower with its position table at std 0.02)")
    ap.add_argument("--patch-size", type=int, default=14, help="the towers' and the patch MLP's patch side")
    ap.add_argument("--max-patches", type=int, default=None, help="patch budget per image (default: the preset's)")
    ap.add_argument("--save", default=None, help="write the trained `tower` classifier's tower weights here")
    args = ap.parse_args()
    if args.save and "tower" not in args.classifiers:
        ap.error("--save keeps the `tower` classifier's weights: add tower to --classifiers")
    torch.set_num_threads(args.threads)
    processor = build_processor(get_preset("tiny").data["pretrain"])
    processor.image_processor = MoonViTImageProcessor(
        max_patches=args.max_patches or processor.image_processor.max_patches, patch_size=args.patch_size)
    task = TASKS[args.task]
    data = (task.items("train", args.draws, 1), task.items("val", 600, 2))
    print(f"{args.task}: {len(data[0])} training and {len(data[1])} validation images, "
          f"{processor.image_processor.max_patches} patches of {args.patch_size} x {args.patch_size} per image at "
          "most\n")
    builders = {"tower": ("tower", lambda: tower_classifier(processor, task, None)),
                "tower-pos": ("tower, position table std 0.02", lambda: tower_classifier(processor, task, 0.02)),
                "patch-mlp": ("patch MLP", lambda: patch_mlp_classifier(processor, task)),
                "cnn": ("CNN", lambda: cnn_classifier(task))}
    for key in args.classifiers:
        name, build = builders[key]
        logits, module = build()
        train(name, logits, module, task, data, args)
        if key == "tower" and args.save:
            torch.save(module["tower"].state_dict(), args.save)
            print(f"  tower weights written to {args.save}")


if __name__ == "__main__":
    main()
