"""ViT training: the MoonViT-3D tower alone on the synthetic world's labelled images, before joint pre-training.

K2.5 does not start joint pre-training from a raw tower: MoonViT is trained on its own first (from SigLIP-SO400M,
with a caption loss: "ViT training", `reference/training_eval.md`), and joint pre-training then teaches the language
model to read what the tower already sees. At the `tiny` preset's scale a tower trained from scratch inside joint
pre-training learns what every image token carries (a colour) but not to count: the quickstart's images hold some
2,800 counting questions over its 2000 steps, each read through the language model's next-token loss, while the
tower alone, with a classification loss on 32 images a step, counts about 60% of held-out images after 1000 steps
(docs/RESULTS.md, "ViT training").

The stand-in here: closed-set labels of the world's images (what a caption would state of them) read by a small
attention read-out over the tower's patches per task (`Readout`: one learned query per target). The read-outs are
training scaffolding; the stage's output is the tower alone, a MoonViT checkpoint that joint pre-training starts
from (`pretrain(..., vision_tower=DIR)`).

Tasks (`VIT_TARGETS`) and what is read off their images (classes):
- `count`: 1-6 objects of one shape and colour; the number of objects (6).
- `color`: one shape; its colour (10).
- `page_color`: a screencast's first frame (the top of its page); the header's and the first section's background
  colours (24 each).
- `chart_bar`: bar charts of 3-5 bars, each value 1-20 printed above its bar; the tallest bar's position (5), the
  largest value (20), the smallest value (20).

Every image is a training-split item of the world (`make_sample`'s default), so the evaluation proxies' images and
charts are never drawn here either. Step `i`'s images are a pure function of `(seed, i)`: a resumed run sees the
batches the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import nn

from ..data.screencast import COLORS as PAGE_COLORS
from ..data.screencast import DARK_COLORS
from ..data.world import COLORS, Sample, make_sample, sample_rng
from ..errors import ConfigError
from ..vision import MoonViTImageProcessor, MoonViTModel


@dataclass(frozen=True)
class Target:
    """One label of a task's images: its `name`, number of `classes`, `label(sample)` in `[0, classes)`, and the
    `chance` of a uniform guess among the values it takes (None where that varies by image)."""

    name: str
    classes: int
    label: Callable[[Sample], int]
    chance: float | None


def _values(sample: Sample) -> list[int]:
    return sample.meta["values"]


_COLOURS, _PAGE_COLOURS = list(COLORS), list(PAGE_COLORS)

VIT_TARGETS: dict[str, tuple[Target, ...]] = {
    "count": (Target("objects", 6, lambda s: s.meta["count"] - 1, 1 / 6),),
    "color": (Target("colour", len(_COLOURS), lambda s: _COLOURS.index(s.answer), 1 / len(_COLOURS)),),
    "page_color": (Target("header", len(_PAGE_COLOURS), lambda s: _PAGE_COLOURS.index(s.video.spec.header_color),
                          1 / len(DARK_COLORS)),
                   Target("first_section", len(_PAGE_COLOURS),
                          lambda s: _PAGE_COLOURS.index(s.video.spec.sections[0].color),
                          1 / (len(PAGE_COLORS) - len(DARK_COLORS)))),
    "chart_bar": (Target("tallest", 5, lambda s: _values(s).index(max(_values(s))), None),  # 1/3 to 1/5
                  Target("largest", 20, lambda s: max(_values(s)) - 1, 1 / 20),
                  Target("smallest", 20, lambda s: min(_values(s)) - 1, 1 / 20)),
}
"""The world's image tasks the ViT stage trains on, and what it reads off each image."""


def check_tasks(tasks: Mapping[str, float] | None) -> dict[str, float]:
    """`tasks` (weights by task name) checked: known tasks, finite weights >= 0, at least one > 0 (`ConfigError`)."""
    if not tasks:
        raise ConfigError(f"vit_tasks is empty; give weights of some of {', '.join(VIT_TARGETS)} (e.g. count=20,"
                          "chart_bar=12).")
    unknown = sorted(set(tasks) - set(VIT_TARGETS))
    if unknown:
        raise ConfigError(f"vit_tasks names {unknown}: the ViT stage trains on {', '.join(VIT_TARGETS)}.")
    weights = {t: float(w) for t, w in tasks.items()}
    if any(not (w >= 0 and w != float("inf")) for w in weights.values()) or not any(weights.values()):
        raise ConfigError(f"vit_tasks weights must be finite, >= 0 and not all 0; got {weights}.")
    return {t: w for t, w in weights.items() if w > 0}


def images_per_task(tasks: Mapping[str, float], images: int) -> dict[str, int]:
    """The step's `images` split between `tasks` by weight (largest remainders round up; the same every step)."""
    total = sum(tasks.values())
    exact = {t: images * w / total for t, w in tasks.items()}
    counts = {t: int(x) for t, x in exact.items()}
    for t in sorted(exact, key=lambda t: counts[t] - exact[t])[:images - sum(counts.values())]:
        counts[t] += 1
    return counts


class Readout(nn.Module):
    """`[sum(sizes), D]` patch features -> one `[num_images, classes]` logit tensor per target: a learned query per
    target attends over each image's own patches (softmax over them) and the target's linear layer reads its classes
    from what the query gathered.

    Args:
        dim: width of the patch features `D`.
        classes: the number of classes of each target.
    """

    def __init__(self, dim: int, classes: Sequence[int]) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(len(classes), dim) / dim ** 0.5)
        self.key = nn.Linear(dim, dim)
        self.outputs = nn.ModuleList(nn.Linear(dim, c) for c in classes)

    def forward(self, features: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        scale = features.shape[-1] ** -0.5
        gathered = torch.stack([(self.queries @ self.key(x).T * scale).softmax(-1) @ x
                                for x in features.split(list(sizes))])  # [num_images, targets, D]
        return [out(gathered[:, i]) for i, out in enumerate(self.outputs)]


class ViTClassifier(nn.Module):
    """The vision tower with one `Readout` per task of `tasks` (names of `VIT_TARGETS`)."""

    def __init__(self, tower: MoonViTModel, tasks: Sequence[str]) -> None:
        super().__init__()
        self.tower = tower
        dim = tower.config.hidden_size
        self.readouts = nn.ModuleDict({t: Readout(dim, [target.classes for target in VIT_TARGETS[t]]) for t in tasks})

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, tasks: Sequence[str]
                ) -> list[list[torch.Tensor]]:
        """`pixel_values [num_patches, 3, p, p]`, `grid_thw [num_images, 3]` and each image's task -> for every
        image, in order, one `[classes]` logit vector per target of its task. The tower reads all images in one
        pack; each task's read-out reads its images."""
        features = self.tower(pixel_values, grid_thw).last_hidden_state
        sizes = grid_thw.prod(-1).tolist()
        per_image = features.split(sizes)
        out: list[list[torch.Tensor]] = [[] for _ in tasks]
        for task in dict.fromkeys(tasks):
            rows = [i for i, t in enumerate(tasks) if t == task]
            logits = self.readouts[task](torch.cat([per_image[i] for i in rows]), [sizes[i] for i in rows])
            for j, i in enumerate(rows):
                out[i] = [target_logits[j] for target_logits in logits]
        return out


def vit_image(sample: Sample) -> Image.Image:
    """The image a sample gives the ViT stage: its image, or a screencast's first frame."""
    return sample.image if sample.image is not None else sample.video.frames[0]


def vit_samples(tasks: Mapping[str, float], images: int, seed: int, step: int, split: str = "train"
                ) -> list[tuple[str, Sample]]:
    """The `(task, sample)` pairs of step `step`: `images_per_task` of each task, from `split`, a pure function of
    `(seed, step)`."""
    out = []
    for task, n in images_per_task(tasks, images).items():
        out += [(task, make_sample(task, sample_rng(seed, step * images + j, f"vit-{task}"), split)) for j in range(n)]
    return out


def _logits(model: nn.Module, processor: MoonViTImageProcessor, items: Sequence[tuple[str, Sample]],
            device: torch.device | str) -> tuple[list[list[torch.Tensor]], int]:
    """`model`'s logits for each `(task, sample)` of `items` (one `[classes]` vector per target), and the patches
    read."""
    inputs = processor([vit_image(s) for _, s in items], return_tensors="pt")
    logits = model(inputs["pixel_values"].to(device), inputs["image_grid_thw"].to(device), [t for t, _ in items])
    return logits, int(inputs["image_grid_thw"].prod(-1).sum())


def vit_loss(model: nn.Module, processor: MoonViTImageProcessor, items: Sequence[tuple[str, Sample]],
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """The mean over `items` of each image's mean cross-entropy over its task's targets, and the patches read."""
    logits, patches = _logits(model, processor, items, device)
    losses = []
    for (task, sample), image_logits in zip(items, logits):
        labels = [target.label(sample) for target in VIT_TARGETS[task]]
        losses.append(torch.stack([nn.functional.cross_entropy(x, torch.tensor(y, device=x.device))
                                   for x, y in zip(image_logits, labels)]).mean())
    return torch.stack(losses).mean(), patches


@torch.no_grad()
def vit_accuracy(model: ViTClassifier, processor: MoonViTImageProcessor, tasks: Sequence[str], n: int = 300,
                 seed: int = 0, batch: int = 50) -> dict[str, float]:
    """Accuracy of every target (`"count.objects"`, `"chart_bar.tallest"`, ...) on `n` validation-split images of
    each task (held out from the stage's training draws)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    right: dict[str, int] = {}
    for task in tasks:
        samples = [make_sample(task, sample_rng(seed, i, f"vit-val-{task}"), "val") for i in range(n)]
        for start in range(0, n, batch):
            chunk = samples[start:start + batch]
            logits, _ = _logits(model, processor, [(task, s) for s in chunk], device)
            for sample, image_logits in zip(chunk, logits):
                for target, x in zip(VIT_TARGETS[task], image_logits):
                    key = f"{task}.{target.name}"
                    right[key] = right.get(key, 0) + int(int(x.argmax()) == target.label(sample))
    model.train(was_training)
    return {key: count / n for key, count in right.items()}


class ViTStep:
    """The ViT stage as the `Trainer`'s step: each optimizer step reads `images` world images (split between
    `tasks` by weight), this process's share of them (`images` must divide by the number of processes)."""

    def __init__(self, processor: MoonViTImageProcessor, tasks: Mapping[str, float], images: int, seed: int) -> None:
        self.processor, self.tasks, self.images, self.seed = processor, check_tasks(tasks), int(images), int(seed)
        if self.images < 1:
            raise ConfigError(f"images_per_step={images} must be at least 1.")

    def start(self, trainer: Any) -> None:
        world = trainer.accelerator.num_processes
        if self.images % world:
            raise ConfigError(f"images_per_step={self.images} does not split over {world} processes; make it a "
                              "multiple of the number of processes.")

    def can_checkpoint(self, step: int) -> bool:
        return True

    def finish(self) -> None:
        pass

    def backward(self, trainer: Any) -> dict[str, Any]:
        acc = trainer.accelerator
        items = vit_samples(self.tasks, self.images, self.seed, trainer.step)[acc.process_index::acc.num_processes]
        with acc.autocast():
            loss, patches = vit_loss(trainer.model, self.processor, items, acc.device)
        acc.backward(loss)  # equal shares: DDP's mean over ranks is the global batch's mean
        stats = torch.tensor([loss.item(), patches], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            torch.distributed.all_reduce(stats)
        return {"loss": stats[0].item() / acc.num_processes, "tokens": int(stats[1]), "bad_records": []}


__all__ = ["VIT_TARGETS", "Readout", "Target", "ViTClassifier", "ViTStep", "check_tasks", "images_per_task",
           "vit_accuracy", "vit_image", "vit_loss", "vit_samples"]
