"""Training stages as functions. Each writes a self-contained Hugging Face checkpoint directory (`config.json`,
`model.safetensors`, processor and tokenizer files, and the remote code: `from_pretrained` loads it after `import
kimi_vl`, or with `trust_remote_code=True` where kimi_vl is not installed) plus `run_config.json` (the resolved
configuration), `metrics.jsonl`, `data_errors.jsonl` (bad records skipped), `plots/`, `state/` (resumable training
state) and `training_summary.json`. Rerunning a stage resumes it from its last checkpoint; a finished stage (its
summary says `complete`) is not rerun: asked again with the same settings it is returned as it is, with others
(`RUN_ONLY_SETTINGS` aside) it raises `ConfigError`.

- `vit`: ViT training, the vision tower alone on the synthetic world's labelled images (`kimi_vl.training.vit`);
  writes a MoonViT checkpoint that `pretrain(..., vision_tower=DIR)` starts from.
- `pretrain`: joint text-vision pre-training (vision tokens from step one; the `tiny` preset: 10% of the tokens in
  the option-letter drill, 15% after), MuonClip, from scratch or with the tower of `vision_tower`; on the embedded
  data, or on users' documents and chats (`sources`) with a BPE tokenizer trained on them.
- `sft`: SFT from a checkpoint, loss on assistant tokens only: zero-vision (text-only chats) on the embedded data,
  or users' chats.
- `rl`: joint text-vision RL from a checkpoint (K2.5 objective, verifiable rewards): on the synthetic world's tasks,
  or users' prompt rows.

Every setting has a name (`kimi_vl.training.config`): pass them as keyword arguments (`pretrain(out, steps=100,
lr=1e-3, sources=["data.jsonl"])`) or a resolved `RunConfig` as `config=`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ..configuration import KimiVLConfig
from ..data.config import DataConfig, data_fingerprint, pretrain_data, rl_prompts, sft_data
from ..data.corpus import tokenizer_texts
from ..data.sources import file_fingerprint
from ..data.world import CURRICULUM_TASKS, TEXT_TASKS, VISION_TASKS, make_sample
from ..errors import CheckpointError, ConfigError, hub_id_hint, read_config_file
from ..export import add_remote_code
from ..modeling import KimiVLForConditionalGeneration
from ..options import check_output_dir
from ..processing import KimiVLProcessor
from ..progress import transformers_bars
from ..text import KimiTextConfig
from ..tokenization import build_tokenizer
from ..tokenization.special_tokens import SPECIAL_TOKENS
from ..vision import MoonViTConfig, MoonViTImageProcessor, MoonViTModel, MoonViTVideoProcessor
from .checkpoint import list_checkpoints
from .config import RUN_CONFIG, RunConfig, resolve, write_run_config
from .distributed import barrier, collective_device, gather_ints, init_distributed, is_main_process
from .plots import plot_metrics, plot_rl_metrics
from .presets import Preset, get_preset, warn_without_cuda
from .rl import RLStep
from .trainer import SKIP_NO_TARGETS, Trainer, read_metrics, unigram_entropy
from .vit import ViTClassifier, ViTStep, check_tasks, vit_accuracy

SUMMARY = "training_summary.json"


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in `path` (a tokenizer folder or a checkpoint), which must have Kimi's special tokens."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no tokenizer can be loaded from {path} ({exc}); pass a kimi-vl checkpoint or tokenizer "
                          "folder.") from exc
    unk = getattr(tok, "unk_token_id", None)
    missing = [t for t in SPECIAL_TOKENS if tok.convert_tokens_to_ids(t) in (None, unk)]
    if missing:
        raise ConfigError(f"the tokenizer in {path} lacks Kimi's special tokens {missing}; pass a kimi-vl "
                          "checkpoint or a tokenizer made by kimi_vl.tokenization.build_tokenizer, or leave "
                          "--tokenizer out to train one on the data.")
    return tok


def build_processor(data: DataConfig, texts: list[str] | None = None, seed: int = 0) -> KimiVLProcessor:
    """The run's processor: the tokenizer of `data.tokenizer`, else a BPE tokenizer trained on `texts` (default:
    the embedded corpus), with the image and video processors `data` sets."""
    if data.tokenizer:
        tokenizer = load_tokenizer(data.tokenizer)
    else:
        tokenizer = build_tokenizer(texts if texts is not None else tokenizer_texts(seed, data.tokenizer_texts),
                                    data.vocab_size)
    return KimiVLProcessor(MoonViTImageProcessor(max_patches=data.image_max_patches), tokenizer,
                           MoonViTVideoProcessor(fps=data.video_fps, max_patches=data.video_max_patches))


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


def summary_line(s: dict[str, Any]) -> str:
    """A stage's `training_summary.json` `s` in a line: steps, final and validation loss or RL reward, bad records,
    time."""
    parts = [f"{s.get('steps')} step{'' if s.get('steps') == 1 else 's'}"]
    if s.get("final_loss") is not None:
        parts.append(f"final loss {s['final_loss']:.3f}")
    if s.get("val_loss") is not None:
        parts.append(f"validation loss {s['val_loss']:.3f}")
    if s.get("reward_first_fifth") is not None:
        parts.append(f"mean reward {s['reward_first_fifth']:.3f} in the first fifth of the steps, "
                     f"{s['reward_last_fifth']:.3f} in the last")
    if s.get("steps_without_targets"):
        n = s["steps_without_targets"]
        parts.append(f"{n} step{'' if n == 1 else 's'} skipped without a loss target")
    if s.get("bad_records"):
        parts.append(f"{s['bad_records']} bad records skipped (data_errors.jsonl)")
    if s.get("wall_time_s") is not None:
        seconds = s["wall_time_s"]
        parts.append(f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min")
    return ", ".join(parts)


def stage_complete(path: str | Path) -> bool:
    summary = read_summary(path)
    return bool(summary and summary.get("complete"))


RUN_ONLY_SETTINGS = frozenset({"progress", "num_workers", "checkpoint_every", "keep_checkpoints", "val_every",
                               "val_batches", "nan_patience", "strict", "max_bad_in_a_row", "allow_data_change",
                               "max_minutes", "activation_checkpointing", "report_to"})
"""Settings that change how a run goes (its reports, checkpoints, loader processes, failure policy), not what it
trains: a finished stage asked again with other values of these is the same run."""


def _complete_on_every_rank(out_dir: Path) -> bool:
    """`stage_complete(out_dir)`, the same on every rank of a launcher's run (its process group starts here). Ranks
    that disagree (an --out on each machine's own disk) raise `CheckpointError`, all of them: those that found the
    stage finished would return, and the others wait for them in the training's first collective until the process
    group's timeout."""
    done = stage_complete(out_dir)
    init_distributed()
    seen = gather_ints(int(done), collective_device())
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {r}: {'finished' if s else 'not finished'}" for r, s in enumerate(seen))
        raise CheckpointError(f"the ranks see different states of {out_dir} ({found}): every rank must read the "
                              "same --out folder, written by rank 0; on several machines put it on a filesystem they "
                              "all mount.")
    return done


def weights_fingerprint(model_dir: str | Path | None) -> list[dict[str, Any]] | None:
    """The `file_fingerprint` of each `*.safetensors` of a checkpoint folder, by name (None: no such folder). A
    stage records its `from` checkpoint's, so a run folder moved or copied elsewhere is still the run it was."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    return [{"name": f.name, **file_fingerprint(f)} for f in sorted(Path(model_dir).glob("*.safetensors"))] or None


def _same_weights(recorded: list[dict[str, Any]] | None, from_dir: str | Path) -> bool:
    return recorded is not None and recorded == weights_fingerprint(from_dir)


def _same_from(was: str | None, recorded: list[dict[str, Any]] | None, from_dir: str | Path) -> bool:
    """Whether a run recorded as started from `was` (whose weights were `recorded`) started from `from_dir`: a folder
    with the recorded weights (a run folder moved or copied elsewhere too; the same folder holding other weights, a
    checkpoint trained again in place, is not); for runs that recorded no weights, the same folder (recorded absolute;
    runs before that: relative to where they were started) or one with the weights still there."""
    if recorded is not None:
        return _same_weights(recorded, from_dir)
    return _same_folder(was, from_dir) or _same_weights(weights_fingerprint(was), from_dir)


def _same_folder(was: str | None, from_dir: str | Path) -> bool:
    return was is not None and Path(was).resolve() == Path(from_dir).resolve()


def _weights_changed(was: str | None, from_dir: str | Path) -> str:
    """A note for a `from` that `_same_from` refused although it names the recorded folder: its weights changed."""
    return " (the same folder, whose weights have changed since)" if _same_folder(was, from_dir) else ""


ORIGIN = "origin.json"
"""In `state/` of an sft or rl run: the checkpoint it started from (`from`, `from_weights`), written at its start
(of a pretrain run: its `vision_tower`)."""


def _check_origin(out_dir: Path, from_dir: str | Path, flag: str = "--from") -> dict[str, Any]:
    """Record in `out_dir/state` that a fresh run starts from `from_dir`, and return that record (`from`, the
    folder resolved; `from_weights`), which the run's summary carries. A run that resumes there from training
    checkpoints started from another `--from` (`flag`) raises `ConfigError`: it would go on from their weights, not
    from `from_dir`'s, and its summary would name `from_dir`."""
    origin = {"from": str(Path(from_dir).resolve()), "from_weights": weights_fingerprint(from_dir)}
    record = out_dir / "state" / ORIGIN
    if list_checkpoints(out_dir / "state"):
        was = json.loads(record.read_text()) if record.is_file() else None  # runs before it was recorded: unknown
        if was is not None and not _same_from(was["from"], was["from_weights"], from_dir):
            raise ConfigError(
                f"{out_dir} holds an unfinished run started from {was['from']}, and resuming it goes on from its "
                f"training checkpoint, trained from that one, not from {from_dir}"
                f"{_weights_changed(was['from'], from_dir)}. Resume it with {flag} "
                f"{was['from']}, or write the new run to another --out (or delete {out_dir}).")
        return origin
    if is_main_process():
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(origin, indent=1))
    return origin


def _finished(out_dir: Path, cfg: RunConfig, from_dir: str | Path | None = None) -> bool:
    """Whether `out_dir` holds a finished run of `cfg` (from `from_dir`), on every rank
    (`_complete_on_every_rank`): then the stage returns it as it is, which makes a rerun (the quickstart's resume)
    free. A finished run of other settings raises `ConfigError`: training it again is not what a rerun does, and
    returning it would pass it off as the run asked for."""
    if not _complete_on_every_rank(out_dir):
        return False
    saved_path = out_dir / RUN_CONFIG
    if not saved_path.is_file():  # written by a version that did not record it: nothing to compare
        return True
    saved = json.loads(saved_path.read_text())
    asked = json.loads(json.dumps(cfg.to_dict()))
    changes = [f"{key} {saved.get(key)!r} -> {asked[key]!r}" for key in ("stage", "preset", "seed")
               if saved.get(key) != asked[key]]
    for section in ("train", "data", "rl"):  # the stage's settings (files written before kept every field)
        old, new = saved.get(section) or {}, asked.get(section) or {}
        changes += [f"{name} {old.get(name)!r} -> {new.get(name)!r}" for name in sorted(new)
                    if name not in RUN_ONLY_SETTINGS and old.get(name) != new.get(name)]
    if from_dir is not None:
        summary = read_summary(out_dir) or {}
        was = summary.get("from")
        if not _same_from(was, summary.get("from_weights"), from_dir):
            changes.append(f"from {was!r} -> {str(from_dir)!r}{_weights_changed(was, from_dir)}")
    if changes:
        raise ConfigError(
            f"{out_dir} holds a finished {cfg.stage} run with other settings ({'; '.join(changes)}), and a finished "
            f"stage is not trained again. Write the new run to another --out (or delete {out_dir}); the finished "
            f"run's settings are in {saved_path}.")
    return True


def load_checkpoint_dir(path: str | Path, progress: bool = True) -> tuple[KimiVLForConditionalGeneration,
                                                                          KimiVLProcessor]:
    """Model (fp32, train mode) and processor from a stage's output directory; transformers' loading bar only where
    `progress` (`transformers_bars`)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a model checkpoint directory (no config.json); pass the --out "
                              "directory of a finished `kimi-vl train` stage." + hub_id_hint(path))
    model_type = read_config_file(path / "config.json").get("model_type")  # before transformers reads the weights
    if model_type != KimiVLConfig.model_type:
        what = f"is a {model_type!r} checkpoint" if model_type else "has a config.json without a model_type"
        raise CheckpointError(f"{path} {what}, not a {KimiVLConfig.model_type} one; pass a folder written by a "
                              "kimi-vl training stage or save_pretrained (convert released weights with kimi-vl "
                              "convert).")
    with transformers_bars(progress):
        model = KimiVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model, KimiVLProcessor.from_pretrained(path)


def _config(stage: str, config: RunConfig | None, preset: str | None, seed: int | None, overrides: dict[str, Any],
            out_dir: Path, default_preset: str = "tiny") -> RunConfig:
    """The stage's resolved configuration (before anything runs: a GPU preset without CUDA warns here, an `out_dir`
    that cannot be a folder is refused). `preset` / `seed` None: not given (`default_preset`, seed 0); a `config`
    takes neither, unless the same as its own, nor settings."""
    check_output_dir(out_dir)
    if config is None:
        config = resolve(stage, preset or default_preset, overrides, seed=0 if seed is None else seed)
    else:
        given = sorted(overrides) + [name for name, value, own in (("preset", preset, config.preset),
                                                                   ("seed", seed, config.seed))
                                     if value is not None and value != own]
        if given or config.stage != stage:
            raise ConfigError(f"pass either a {stage} RunConfig or settings, not both (got {given}); change the "
                              "RunConfig instead (dataclasses.replace, or resolve with these settings).")
    warn_without_cuda(config.preset)
    return config


def _preset_of(from_dir: str | Path) -> str:
    """The preset of the run in `from_dir` (`tiny` where its summary does not say)."""
    return (read_summary(from_dir) or {}).get("preset", "tiny")


def _finish(stage: str, model: Any, weights: dict[str, torch.Tensor], processor: KimiVLProcessor, out_dir: Path,
            summary: dict[str, Any], progress: bool) -> Path:
    """Save the stage's checkpoint directory, self-contained (remote code and `auto_map`: any Hugging Face client
    loads it with `trust_remote_code=True`, without kimi_vl installed), and its summary. `weights`: the model's full
    state dict (`Accelerator.get_state_dict`: under FSDP2 every rank gathers it, then rank 0 saves); transformers'
    writing bar only where `progress` (`transformers_bars`)."""
    with transformers_bars(progress):
        model.save_pretrained(out_dir, state_dict=weights)
    processor.save_pretrained(out_dir)
    add_remote_code(out_dir)
    (out_dir / SUMMARY).write_text(json.dumps({"stage": stage, **summary, "complete": True}, indent=1))
    return out_dir


def _train(cfg: RunConfig, model: KimiVLForConditionalGeneration, processor: KimiVLProcessor, out_dir: Path,
           extra: dict[str, Any]) -> Path:
    """A language-model stage (pretrain or sft) on its data, then the checkpoint directory and its summary."""
    t0 = time.perf_counter()
    build = pretrain_data if cfg.stage == "pretrain" else sft_data
    data, val, mixture = build(cfg.data, processor, cfg.seed)
    baseline = unigram_entropy(getattr(data, "main", data))  # a warm-up phase is not the data's steady state
    trainer = Trainer(model, data, cfg.train, out_dir, val_data=val, desc=cfg.stage,
                      fingerprint=data_fingerprint(mixture, cfg.seed, screencasts=cfg.stage == "pretrain"),
                      allow_data_change=cfg.data.allow_data_change,
                      num_workers=cfg.data.num_workers, hyperparameters=cfg.flat())
    if trainer.accelerator.is_main_process:
        write_run_config(cfg, out_dir)
    last = trainer.train()
    weights = trainer.accelerator.get_state_dict(trainer.model)  # on every rank: FSDP2 gathers its shards
    if not trainer.accelerator.is_main_process:
        return out_dir
    model = trainer.accelerator.unwrap_model(trainer.model)
    metrics = read_metrics(out_dir / "metrics.jsonl")
    plot_metrics(metrics, out_dir / "plots", title=cfg.stage, baseline=baseline)
    bad = sum(sum(m.get("bad_records", {}).values()) for m in metrics)
    without_targets = sum(m.get("skip_reason") == SKIP_NO_TARGETS for m in metrics)
    return _finish(cfg.stage, model, weights, processor, out_dir, {
        "preset": cfg.preset, "seed": cfg.seed, **extra, "data": cfg.data.sources or "embedded",
        "steps": cfg.train.steps, "final_loss": last.get("loss"), "val_loss": last.get("val_loss"),
        "unigram_baseline": baseline, "tokens": last.get("tokens"), "skipped_steps": last.get("skipped_total"),
        "steps_without_targets": without_targets, "bad_records": bad, "wall_time_s": time.perf_counter() - t0},
        cfg.train.progress)


PROCESSOR_SETTINGS = ("tokenizer", "vocab_size", "tokenizer_texts", "image_max_patches", "video_max_patches",
                      "video_fps")
"""The data settings a pre-training run builds its processor from (`build_processor`)."""


def _check_same_processor(out_dir: Path, cfg: RunConfig) -> None:
    """`ConfigError` when the run saved in `out_dir` was started with another preset or other `PROCESSOR_SETTINGS`
    than `cfg`: a resumed run keeps the processor saved at its start (its model's vocabulary is that tokenizer's),
    so it cannot honour them, and its `run_config.json` would record settings it never trained with."""
    saved_path = out_dir / RUN_CONFIG
    try:
        saved = json.loads(saved_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # killed before or while writing it: nothing trained yet
        return
    asked = json.loads(json.dumps(cfg.to_dict()))
    old, new = saved.get("data") or {}, asked["data"]
    changes = [f"preset {saved.get('preset')!r} -> {cfg.preset!r}"] if saved.get("preset") != cfg.preset else []
    changes += [f"{name} {old[name]!r} -> {new[name]!r}" for name in PROCESSOR_SETTINGS
                if name in old and old[name] != new[name]]
    if changes:
        raise ConfigError(
            f"{out_dir} holds a {cfg.stage} run started with another processor or model ({'; '.join(changes)}), "
            "and a resumed run keeps the tokenizer, image and video processors and model it started with. Resume it "
            f"with its settings (in {saved_path}), or write the new run to another --out (or delete {out_dir}).")


def _processor_for(out_dir: Path, cfg: RunConfig) -> KimiVLProcessor:
    """The run's processor: saved at the start of a run, so a resumed run uses the very same tokenizer (asked for
    another one, it raises `ConfigError`: `_check_same_processor`)."""
    saved = (out_dir / "processor_config.json").is_file()  # written last: a run killed while saving saves it again
    barrier()  # every rank has looked before rank 0 writes: a rank reading a half-written file would fail alone
    if saved:
        _check_same_processor(out_dir, cfg)
        return KimiVLProcessor.from_pretrained(out_dir)
    texts = None
    if cfg.data.sources and not cfg.data.tokenizer:  # deterministic: every rank trains the same tokenizer
        texts = cfg.data.mixture(cfg.data.sources, cfg.seed, ("document", "chat")).texts(cfg.data.tokenizer_texts)
    processor = build_processor(cfg.data, texts, cfg.seed)
    if is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(out_dir)
    return processor


VIT_VAL_IMAGES = 300
"""Validation-split images per task on which the ViT stage's summary reports each target's accuracy."""


def vit(out_dir: str | Path, *, preset: str | None = None, seed: int | None = None,
        config: RunConfig | None = None, **settings: Any) -> Path:
    """ViT training (`kimi_vl.training.vit`): the preset's vision tower alone, with a read-out per task, on the
    world's labelled images (preset `tiny` and seed 0 unless given). `out_dir` receives the tower as a MoonViT
    checkpoint (`config.json`, `model.safetensors`, the image processor's `preprocessor_config.json`) for
    `pretrain(..., vision_tower=out_dir)`, with the stage's records; its summary gives each target's accuracy on
    held-out images. Returns `out_dir`."""
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    cfg = _config("vit", config, preset, seed, settings, out_dir)
    if _finished(out_dir, cfg):
        return out_dir
    tasks = check_tasks(cfg.data.vit_tasks)
    images = MoonViTImageProcessor(max_patches=cfg.data.image_max_patches)
    p = get_preset(cfg.preset)
    torch.manual_seed(cfg.seed)
    model = ViTClassifier(MoonViTModel(MoonViTConfig(**p.vision)), list(tasks))
    trainer = Trainer(model, ViTStep(images, tasks, cfg.data.images_per_step, cfg.seed), cfg.train, out_dir,
                      desc="vit", fingerprint=data_fingerprint(None, cfg.seed), hyperparameters=cfg.flat())
    if trainer.accelerator.is_main_process:
        write_run_config(cfg, out_dir)
    last = trainer.train()
    weights = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.accelerator.is_main_process:
        return out_dir
    model = trainer.accelerator.unwrap_model(trainer.model)
    accuracy = vit_accuracy(model, images, list(tasks), VIT_VAL_IMAGES, seed=cfg.seed)
    metrics = read_metrics(out_dir / "metrics.jsonl")
    plot_metrics(metrics, out_dir / "plots", title="ViT training")
    tower = {k.removeprefix("tower."): v for k, v in weights.items() if k.startswith("tower.")}
    with transformers_bars(cfg.train.progress):
        model.tower.save_pretrained(out_dir, state_dict=tower)
    images.save_pretrained(out_dir)
    (out_dir / SUMMARY).write_text(json.dumps({
        "stage": "vit", "preset": cfg.preset, "seed": cfg.seed, "tasks": tasks, "steps": cfg.train.steps,
        "final_loss": last.get("loss"), "val_accuracy": accuracy, "val_images_per_task": VIT_VAL_IMAGES,
        "images": cfg.train.steps * cfg.data.images_per_step, "wall_time_s": time.perf_counter() - t0,
        "complete": True}, indent=1))
    return out_dir


def load_vision_tower(model: KimiVLForConditionalGeneration, path: str | Path) -> None:
    """Load the MoonViT checkpoint in `path` (the ViT stage's output, or a converted tower) into `model`'s vision
    tower; `CheckpointError` when it is no MoonViT checkpoint or has another shape than the model's tower."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"vision_tower {path} holds no config.json; pass the --out folder of `kimi-vl train vit` "
                              "(or a tower converted by `kimi-vl convert kimi-k25-vision`).")
    model_type = read_config_file(path / "config.json").get("model_type")
    if model_type != MoonViTConfig.model_type:
        raise CheckpointError(f"vision_tower {path} is a {model_type!r} checkpoint, not a {MoonViTConfig.model_type} "
                              "tower; pass the --out folder of `kimi-vl train vit`.")
    with transformers_bars(False):
        tower = MoonViTModel.from_pretrained(path, dtype=torch.float32)
    own, theirs = model.vision_tower.state_dict(), tower.state_dict()
    mismatched = [f"{k} {tuple(theirs[k].shape) if k in theirs else 'missing'} vs {tuple(v.shape)}"
                  for k, v in own.items() if k not in theirs or theirs[k].shape != v.shape]
    if mismatched:
        raise CheckpointError(f"vision_tower {path} has another shape than this preset's tower "
                              f"({'; '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''}); train it with "
                              "the same preset (`kimi-vl train vit --preset ...`).")
    model.vision_tower.load_state_dict(theirs)


def pretrain(out_dir: str | Path, *, preset: str | None = None, seed: int | None = None,
             config: RunConfig | None = None, **settings: Any) -> Path:
    """Joint text-vision pre-training (preset `tiny` and seed 0 unless given), from scratch or with the vision tower
    of the `vision_tower` setting (a ViT stage's output); returns the checkpoint directory `out_dir`."""
    out_dir = Path(out_dir)
    cfg = _config("pretrain", config, preset, seed, settings, out_dir)
    tower = cfg.train.vision_tower
    if _finished(out_dir, cfg, tower):
        return out_dir
    processor = _processor_for(out_dir, cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(get_preset(cfg.preset), processor)
    origin = {}
    if tower is not None:
        load_vision_tower(model, tower)  # a resumed run then loads its checkpoint over it
        origin = _check_origin(out_dir, tower, "--vision-tower")
    return _train(cfg, model, processor, out_dir, origin)


def sft(from_dir: str | Path, out_dir: str | Path, *, preset: str | None = None, seed: int | None = None,
        config: RunConfig | None = None, **settings: Any) -> Path:
    """SFT of the checkpoint in `from_dir` (zero-vision on the embedded data); returns `out_dir`."""
    out_dir = Path(out_dir)
    cfg = _config("sft", config, preset, seed, settings, out_dir, _preset_of(from_dir))
    if _finished(out_dir, cfg, from_dir):
        return out_dir
    model, processor = load_checkpoint_dir(from_dir, cfg.train.progress)
    return _train(cfg, model, processor, out_dir, _check_origin(out_dir, from_dir))


RL_FAMILIES = {"text": tuple(t for t in TEXT_TASKS if t not in ("fact", "lookup")),
               "vision": tuple(t for t in VISION_TASKS if t not in CURRICULUM_TASKS)}
"""RL task families of the embedded data: verifiable text tasks (arithmetic, multiple choice) and image tasks
(counting, colours, shapes, charts, OCR, grounding, visual math); `fact` (free-text answers), the `lookup` drill and
the `swatch` curriculum are left to pre-training and SFT."""


def family_tasks(families: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The world tasks of RL task families (`RL_FAMILIES`)."""
    unknown = [f for f in families if f not in RL_FAMILIES]
    if unknown or not families:
        raise ConfigError(f"unknown RL task families {unknown or families}; choose from {', '.join(RL_FAMILIES)} "
                          "(both: text,vision).")
    return tuple(t for f in families for t in RL_FAMILIES[f])


def world_prompts(families: Sequence[str], per_family: int, seed: int, step: int) -> list[Any]:
    """Rollout batch `step`'s world samples: `per_family` of each task family in `families`, in that order. A
    family's tasks are dealt round-robin across the steps (from an offset drawn from `seed`), so every task of the
    family gets the same share of its prompts, exactly over each cycle; adding a family adds its prompts and takes
    none from the others. A pure function of `(seed, step)`."""
    out = []
    for family in families:
        tasks = family_tasks([family])
        start = random.Random(f"rl-prompts:{seed}:{family}").randrange(len(tasks)) + step * per_family
        out += [make_sample(tasks[(start + j) % len(tasks)], random.Random(f"rl:{seed}:{step}:{family}:{j}"))
                for j in range(per_family)]
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(m[key] for m in rows) / len(rows)


def family_rewards(rows: list[dict[str, Any]], families: Sequence[str]) -> dict[str, float | None]:
    """Mean reward of each task family over metric rows: the mean of its tasks' `reward/<task>` entries (each the
    mean over that task's prompts of a step), so every task of the family weighs the same. That is the mean over
    prompts where each task gets as many prompts per step (the vision family's 8 prompts over its 8 tasks), not quite
    where they differ (the text family's 8 prompts over its 3 tasks, 3 / 3 / 2). None for a family with no prompt in
    `rows`."""
    out: dict[str, float | None] = {}
    for family in families:
        values = [m[f"reward/{t}"] for m in rows for t in family_tasks([family]) if f"reward/{t}" in m]
        out[family] = sum(values) / len(values) if values else None
    return out


def rl(from_dir: str | Path, out_dir: str | Path, *, preset: str | None = None, seed: int | None = None,
       config: RunConfig | None = None, **settings: Any) -> Path:
    """Joint text-vision RL of the checkpoint in `from_dir` (K2.5 objective unless `algorithm="grpo"`) on the
    `Trainer` (`RLStep`); rollout batch `i` draws `prompts_per_step` prompts (users' rows, or world samples of the
    task families `families`), a pure function of `(seed, i)`, so a resumed run is the uninterrupted one. Returns the
    checkpoint directory `out_dir`."""
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    cfg = _config("rl", config, preset, seed, settings, out_dir, _preset_of(from_dir))
    if _finished(out_dir, cfg, from_dir):
        return out_dir
    data = cfg.data
    if not data.sources:
        family_tasks(data.families)  # known families
    model, processor = load_checkpoint_dir(from_dir, cfg.train.progress)
    origin = _check_origin(out_dir, from_dir)
    prompts = rl_prompts(data, cfg.seed, processor)
    if prompts is None:
        source = lambda index: (world_prompts(data.families, data.prompts_per_family, cfg.seed, index), [])  # noqa: E731
    else:
        source = prompts.prompts
    ref_model = None
    if cfg.rl.algorithm == "grpo" and cfg.rl.kl_coef > 0:  # GRPO's KL is to the starting checkpoint, held fixed
        ref_model = load_checkpoint_dir(from_dir, cfg.train.progress)[0].eval().requires_grad_(False)
    label = "+".join(data.families) if prompts is None else "data"
    trainer = Trainer(model, RLStep(source, processor, cfg.rl, seed=cfg.seed, ref_model=ref_model), cfg.train, out_dir,
                      desc=f"rl ({label})", fingerprint=data_fingerprint(prompts and prompts.mixture, cfg.seed),
                      allow_data_change=data.allow_data_change, hyperparameters=cfg.flat())
    if trainer.accelerator.is_main_process:
        write_run_config(cfg, out_dir)
    trainer.train()
    weights = trainer.accelerator.get_state_dict(trainer.model)  # on every rank: FSDP2 gathers its shards
    if not trainer.accelerator.is_main_process:
        return out_dir
    metrics = read_metrics(out_dir / "metrics.jsonl")
    plot_rl_metrics(metrics, out_dir / "plots", title=f"RL ({label})")
    first, last = metrics[: max(1, len(metrics) // 5)], metrics[-max(1, len(metrics) // 5):]
    return _finish("rl", trainer.accelerator.unwrap_model(trainer.model), weights, processor, out_dir, {
        "preset": cfg.preset, "seed": cfg.seed, **origin,
        "families": list(data.families) if prompts is None else None, "data": data.sources or "embedded",
        "steps": cfg.train.steps, "algorithm": cfg.rl.algorithm, "k": cfg.rl.k,
        "prompts_per_step": (data.prompts_per_family * len(data.families) if prompts is None
                             else data.prompts_per_step), "updates_per_batch": cfg.rl.updates_per_batch,
        "reward_first_fifth": _mean(first, "reward_mean"), "reward_last_fifth": _mean(last, "reward_mean"),
        "family_reward_first_fifth": family_rewards(first, data.families) if prompts is None else None,
        "family_reward_last_fifth": family_rewards(last, data.families) if prompts is None else None,
        "masked_fraction": _mean(metrics, "masked_fraction"),
        "log_ratio_abs_mean": _mean(metrics, "log_ratio_abs_mean"),
        "bad_records": sum(sum(m.get("bad_records", {}).values()) for m in metrics),
        "wall_time_s": time.perf_counter() - t0}, cfg.train.progress)
