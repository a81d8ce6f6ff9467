"""How many steps the tiny model needs to start reading images, at a given vision-token ratio.

Joint pre-training from scratch (the `tiny` preset's model, tokenizer and packing, MuonClip: 8 x 256-token batches
since 2026-11-27; docs/RESULTS.md's figures of this script were measured with the 4 x 256 before) where
every image document is a one-shape colour question in chat form and every text document an arithmetic sample.
Every `--every` steps it prints the colour accuracy (teacher-forced, `skills.colour_accuracy`; chance 10%). With
`--task count` (or `chart_bar`, `ocr`) the image documents are the world's counting (bar-value, printed-word)
questions instead and the accuracy is that of greedy answers (`skills.answer_accuracy`, 60 val items; chance 1/6 for
counts 1-6, 1/20 for bar values 1-20, about 2% for `ocr`'s one or two printed capital words of 40, font size 12-22);
`--max-patches` sets the image processor's patch budget (the preset's: 64). With
`--vision-loss-weight w` the loss of the image documents' tokens is weighted `w` times the text's. With
`--swatch-steps n` the first n steps' image documents are one-colour images (the world's `swatch` task: "What color
is the image?") instead: the curriculum of the tiny preset. `--vision-hidden` and `--vision-layers` widen and deepen
the vision tower (its MLP 2x the width; the preset's: 64 and 2). `--tower PATH` starts from a vision tower trained
beforehand (`bench/ocr_tower.py --save PATH`, the preset's tower shape), as K2.5 trains its ViT before joint
pre-training; `--freeze-tower` keeps the tower's weights fixed (only the projector and the language model learn;
without `--tower` it holds the untrained tower fixed: the control).

    python bench/vision_ratio.py --ratio 0.6 --steps 300
    python bench/vision_ratio.py --ratio 0.1 --steps 250 --vision-loss-weight 5
    python bench/vision_ratio.py --ratio 0.1 --steps 250 --swatch-steps 100
    python bench/vision_ratio.py --ratio 0.6 --steps 600 --swatch-steps 50 --task count --max-patches 144
    python bench/vision_ratio.py --ratio 0.6 --steps 600 --swatch-steps 50 --task chart_bar --vision-hidden 128 \
        --vision-layers 4
    python bench/vision_ratio.py --ratio 0.6 --steps 600 --swatch-steps 50 --task ocr --tower runs/ocr/tower.pt
    python bench/vision_ratio.py --ratio 0.6 --steps 600 --swatch-steps 50 --task ocr --tower runs/ocr/tower.pt \
        --freeze-tower
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from skills import answer_accuracy, colour_accuracy

from kimi_vl.data import PackedBatch, embedded_pretrain_stream
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import build_model, build_processor
from kimi_vl.training.trainer import TrainConfig, build_optimizer


def weighted_loss(model, batch: PackedBatch, image_token_id: int, weight: float) -> torch.Tensor:
    """Mean next-token loss with the tokens of documents holding an image weighted `weight`."""
    inputs = batch.model_inputs()
    labels = inputs.pop("labels")[0, 1:]
    logits = model(**inputs).logits[0, :-1]
    ids, bounds = batch.input_ids[0], batch.cu_seqlens.tolist()
    weights = torch.ones(len(ids))
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (ids[start:end] == image_token_id).any():
            weights[start:end] = weight
    mask = labels != -100
    losses = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="none")
    return (losses * weights[1:][mask]).sum() / weights[1:][mask].sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.1, help="vision tokens / all tokens of each batch")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vision-loss-weight", type=float, default=1.0)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--swatch-steps", type=int, default=0, help="first steps whose images are one-colour swatches")
    ap.add_argument("--task", choices=("color", "count", "chart_bar", "ocr"), default="color",
                    help="the world's image task of the image documents after the swatch steps")
    ap.add_argument("--max-patches", type=int, default=None, help="patch budget per image (default: the preset's)")
    ap.add_argument("--vision-hidden", type=int, default=None, help="vision tower width (default: the preset's)")
    ap.add_argument("--vision-layers", type=int, default=None, help="vision tower depth (default: the preset's)")
    ap.add_argument("--tower", default=None, help="vision tower weights to start from (bench/ocr_tower.py --save)")
    ap.add_argument("--freeze-tower", action="store_true", help="train the projector and language model only")
    args = ap.parse_args()
    preset = get_preset("tiny")
    vision = dict(preset.vision)
    if args.vision_hidden:
        vision.update(hidden_size=args.vision_hidden, intermediate_size=2 * args.vision_hidden)
    if args.vision_layers:
        vision.update(num_hidden_layers=args.vision_layers)
    preset = dataclasses.replace(preset, vision=vision)
    data = preset.data["pretrain"]
    if args.max_patches:
        data = dataclasses.replace(data, image_max_patches=args.max_patches)
    processor = build_processor(data)
    torch.manual_seed(0)
    model = build_model(preset, processor)
    if args.tower:
        model.vision_tower.load_state_dict(torch.load(args.tower, weights_only=True))
    model.vision_tower.requires_grad_(not args.freeze_tower)
    streams = {task: embedded_pretrain_stream(processor, seed=0, seq_len=data.seq_len, rows=data.rows,
                                              vision_ratio=args.ratio, chat_fraction=1.0, video_fraction=0.0,
                                              code_fraction=0.0, text_tasks={"arithmetic": 1.0},
                                              vision_tasks={task: 1.0})
               for task in ("swatch", args.task)}
    optimizer = build_optimizer(model, TrainConfig(steps=args.steps, lr=args.lr))
    t0 = time.perf_counter()
    print(f"task {args.task}, vision ratio {args.ratio}, lr {args.lr}, image-document loss weight "
          f"{args.vision_loss_weight}, {args.swatch_steps} swatch steps first, {processor.image_processor.max_patches} "
          f"patches per image, vision tower {vision['hidden_size']} wide and {vision['num_hidden_layers']} deep "
          f"({sum(p.numel() for p in model.vision_tower.parameters()):,} parameters"
          f"{', from ' + args.tower if args.tower else ''}{', frozen' if args.freeze_tower else ''})")
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20)
        stream = streams["swatch" if step < args.swatch_steps else args.task]
        loss = weighted_loss(model, stream.batch(step), processor.image_token_id, args.vision_loss_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.every == 0:
            model.eval()
            accuracy = (colour_accuracy(model, processor) if args.task == "color"
                        else answer_accuracy(model, processor, args.task, "val"))
            model.train()
            print(f"step {step + 1}: loss {loss.item():.3f}, {args.task} accuracy {100 * accuracy:.1f}% "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
