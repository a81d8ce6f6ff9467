"""Training stages as functions. Each writes a Hugging Face checkpoint directory (`config.json`,
`model.safetensors`, processor and tokenizer files: `from_pretrained` loads it) plus `metrics.jsonl`, `plots/`,
`state/` (resumable training state) and `training_summary.json`. Rerunning a stage resumes it from its last
checkpoint; a finished stage (its summary says `complete`) is not rerun.

- `pretrain`: joint text-vision pre-training from scratch on the embedded corpus (a constant vision-token ratio
  from step one), MuonClip.
- `sft`: zero-vision SFT from a checkpoint: text-only chats, loss on assistant tokens only.
- `rl`: joint text-vision RL from a checkpoint (K2.5 objective, verifiable rewards on synthetic-world tasks).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..configuration import KimiVLConfig
from ..data import embedded_pretrain_stream, embedded_sft_stream
from ..data.corpus import tokenizer_texts
from ..data.world import TEXT_TASKS, VISION_TASKS, make_samples
from ..errors import CheckpointError, ConfigError
from ..fusion import build_tokenizer
from ..modeling import KimiVLForConditionalGeneration
from ..processing import KimiVLProcessor
from ..text import KimiTextConfig
from ..vision import MoonViTConfig, MoonViTImageProcessor, MoonViTVideoProcessor
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .muonclip import MuonClip
from .plots import plot_metrics, plot_rl_metrics
from .presets import Preset, get_preset
from .rl import RLConfig, rl_iteration
from .trainer import TrainConfig, Trainer, read_metrics, rewind_metrics, unigram_entropy

SUMMARY = "training_summary.json"
VAL_SEED_OFFSET = 1_000_003  # validation batches come from a disjoint seed


def build_processor(preset: Preset, seed: int = 0) -> KimiVLProcessor:
    """Train the BPE tokenizer on the embedded corpus and wrap it with the preset's image and video processors."""
    tokenizer = build_tokenizer(tokenizer_texts(seed, preset.tokenizer_texts), preset.vocab_size)
    return KimiVLProcessor(MoonViTImageProcessor(max_patches=preset.image_max_patches), tokenizer,
                           MoonViTVideoProcessor(fps=preset.video_fps, max_patches=preset.video_max_patches))


def build_model(preset: Preset, processor: KimiVLProcessor) -> KimiVLForConditionalGeneration:
    tok = processor.tokenizer
    text = KimiTextConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, **preset.text)
    config = KimiVLConfig(vision_config=MoonViTConfig(**preset.vision), text_config=text,
                          image_token_id=processor.image_token_id, video_token_id=processor.video_token_id)
    return KimiVLForConditionalGeneration(config)


def read_summary(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / SUMMARY
    return json.loads(f.read_text()) if f.is_file() else None


def stage_complete(path: str | Path) -> bool:
    summary = read_summary(path)
    return bool(summary and summary.get("complete"))


def load_checkpoint_dir(path: str | Path) -> tuple[KimiVLForConditionalGeneration, KimiVLProcessor]:
    """Model (fp32, train mode) and processor from a stage's output directory."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a model checkpoint directory (no config.json); pass the --out "
                              "directory of a finished `kimi-vl train` stage.")
    model = KimiVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model, KimiVLProcessor.from_pretrained(path)


def _run(stage: str, model: KimiVLForConditionalGeneration, processor: KimiVLProcessor, data, val_data,
         cfg: TrainConfig, out_dir: Path, extra: dict[str, Any]) -> Path:
    t0 = time.perf_counter()
    baseline = unigram_entropy(getattr(data, "main", data))  # a warm-up phase is not the data's steady state
    trainer = Trainer(model, data, cfg, out_dir, val_data=val_data, desc=stage)
    last = trainer.train()
    if not trainer.accelerator.is_main_process:
        return out_dir
    model = trainer.accelerator.unwrap_model(trainer.model)
    metrics = read_metrics(out_dir / "metrics.jsonl")
    plot_metrics(metrics, out_dir / "plots", title=stage, baseline=baseline)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    summary = {"stage": stage, **extra, "steps": cfg.steps, "final_loss": last.get("loss"),
               "val_loss": last.get("val_loss"), "unigram_baseline": baseline, "tokens": last.get("tokens"),
               "skipped_steps": last.get("skipped_total"), "wall_time_s": time.perf_counter() - t0,
               "complete": True}
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return out_dir


def _processor_for(out_dir: Path, preset: Preset, seed: int) -> KimiVLProcessor:
    """The run's processor: saved at the start of a run, so a resumed run uses the very same tokenizer."""
    if (out_dir / "tokenizer.json").is_file():
        return KimiVLProcessor.from_pretrained(out_dir)
    processor = build_processor(preset, seed)  # deterministic: every rank builds the same one
    if int(os.environ.get("RANK", "0")) == 0:  # before the process group exists, the launcher's rank
        out_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(out_dir)
    return processor


def pretrain(out_dir: str | Path, *, preset: str = "tiny", steps: int | None = None, seed: int = 0,
             progress: bool = True, **overrides: Any) -> Path:
    """Joint text-vision pre-training from scratch; returns the checkpoint directory `out_dir`."""
    out_dir = Path(out_dir)
    if stage_complete(out_dir):
        return out_dir
    p = get_preset(preset)
    cfg = TrainConfig(**{**p.pretrain, **overrides, **({"steps": steps} if steps else {}), "progress": progress})
    processor = _processor_for(out_dir, p, seed)
    torch.manual_seed(seed)
    model = build_model(p, processor)
    stream = dict(seq_len=p.seq_len, rows=p.rows, vision_ratio=p.vision_ratio, **p.pretrain_data)
    data = embedded_pretrain_stream(processor, seed=seed, **stream)
    val = embedded_pretrain_stream(processor, seed=seed + VAL_SEED_OFFSET, **{**stream, "drill_batches": 0})
    return _run("pretrain", model, processor, data, val, cfg, out_dir, {"preset": preset, "seed": seed})


def sft(from_dir: str | Path, out_dir: str | Path, *, preset: str | None = None, steps: int | None = None,
        seed: int = 0, progress: bool = True, **overrides: Any) -> Path:
    """Zero-vision SFT of the checkpoint in `from_dir`; returns the checkpoint directory `out_dir`."""
    out_dir = Path(out_dir)
    if stage_complete(out_dir):
        return out_dir
    preset = preset or (read_summary(from_dir) or {}).get("preset", "tiny")
    p = get_preset(preset)
    cfg = TrainConfig(**{**p.sft, **overrides, **({"steps": steps} if steps else {}), "progress": progress})
    model, processor = load_checkpoint_dir(from_dir)
    data = embedded_sft_stream(processor, seq_len=p.seq_len, rows=p.rows, seed=seed)
    val = embedded_sft_stream(processor, seq_len=p.seq_len, rows=p.rows, seed=seed + VAL_SEED_OFFSET)
    return _run("sft", model, processor, data, val, cfg, out_dir,
                {"preset": preset, "seed": seed, "from": str(from_dir)})


RL_TASKS = {"text": tuple(t for t in TEXT_TASKS if t not in ("fact", "lookup")), "vision": VISION_TASKS}
"""RL task families: verifiable text tasks (arithmetic, multiple choice) and image tasks (counting, colours,
shapes, charts, OCR, grounding, visual math); `fact` (free-text answers) and the `lookup` drill are left to
pre-training and SFT."""


def rl_tasks(families: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    unknown = [f for f in families if f not in RL_TASKS]
    if unknown or not families:
        raise ConfigError(f"unknown RL task families {unknown or families}; choose from {', '.join(RL_TASKS)}.")
    return tuple(t for f in families for t in RL_TASKS[f])


def rl(from_dir: str | Path, out_dir: str | Path, *, tasks: tuple[str, ...] | list[str] = ("text", "vision"),
       preset: str | None = None, steps: int | None = None, seed: int = 0, progress: bool = True,
       checkpoint_every: int = 10, **overrides: Any) -> Path:
    """Joint text-vision RL of the checkpoint in `from_dir` (K2.5 objective unless `algorithm="grpo"` is passed);
    step `i` draws `prompts_per_step` fresh world samples cycling through the task families' tasks (a pure function
    of `(seed, i)`, so a resumed run is the uninterrupted one). Returns the checkpoint directory `out_dir`."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    if stage_complete(out_dir):
        return out_dir
    preset = preset or (read_summary(from_dir) or {}).get("preset", "tiny")
    settings = {**get_preset(preset).rl, **overrides}
    total = steps or settings.pop("steps")
    settings.pop("steps", None)
    prompts, lr = settings.pop("prompts_per_step"), settings.pop("lr")
    cfg = RLConfig.from_dict(settings)
    task_list = rl_tasks(tasks)
    model, processor = load_checkpoint_dir(from_dir)
    model.language_model.model.reset_expert_loads()
    optimizer = MuonClip(model, lr, weight_decay=0.0)
    state_dir, metrics_path = out_dir / "state", out_dir / "metrics.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    step, t0 = 0, time.perf_counter()
    if (last := latest_checkpoint(state_dir)) is not None:
        step = load_checkpoint(last, model=model, optimizer=optimizer)["step"]
    rewind_metrics(metrics_path, step)
    bar = tqdm(total=total, initial=step, desc=f"rl ({'+'.join(tasks)})", disable=not progress, dynamic_ncols=True)
    while step < total:
        samples = make_samples(task_list, prompts, seed=seed * 1_000_003 + step)
        metrics, _ = rl_iteration(model, optimizer, processor, samples, cfg, seed=seed * 1_000_003 + step)
        model.language_model.model.update_router_biases()
        step += 1
        with open(metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}")
        if step % checkpoint_every == 0 or step == total:
            save_checkpoint(state_dir, step, model=model, optimizer=optimizer, trainer_state={"tasks": list(tasks)})
    bar.close()
    metrics = read_metrics(metrics_path)
    plot_rl_metrics(metrics, out_dir / "plots", title=f"RL ({'+'.join(tasks)})")
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    first, last_ = metrics[: max(1, len(metrics) // 5)], metrics[-max(1, len(metrics) // 5):]
    summary = {"stage": "rl", "preset": preset, "seed": seed, "from": str(from_dir), "tasks": list(tasks),
               "steps": total, "algorithm": cfg.algorithm, "k": cfg.k, "prompts_per_step": prompts,
               "reward_first_fifth": sum(m["reward_mean"] for m in first) / len(first),
               "reward_last_fifth": sum(m["reward_mean"] for m in last_) / len(last_),
               "wall_time_s": time.perf_counter() - t0, "complete": True}
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return out_dir
