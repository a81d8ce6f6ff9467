"""`DataConfig`: what a training stage reads and how it packs it, and the builders that turn it into batches.

Each field is also a command-line option of `kimi-vl train STAGE` (`--seq-len`, `--data`, ...) and a key of
`--config FILE`; a field's `stages` metadata lists the stages it applies to. Without `sources` every stage trains on
the embedded data (the standard library corpus and the synthetic world), which is what the quickstart uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .embedded import embedded_pretrain_stream, embedded_sft_stream
from .mixture import Mixture, PromptStream, mixture_stream
from .pack import PackedStream, WarmupStream
from .screencast import screencast_font
from .sources import open_source

ALL = ("pretrain", "sft", "rl")
PACKED = ("pretrain", "sft")


def _for(*stages: str, flag: str | None = None, default: Any = None, factory: Any = None, split: str | None = None
         ) -> Any:
    meta = {"stages": stages, **({"flag": flag} if flag else {}), **({"split": split} if split else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    """Data settings of one stage.

    Attributes:
        sources: data sources, each a file, a folder, a glob or hf:ORG/NAME[:CONFIG][@SPLIT], optionally with a
            sampling weight as SRC=WEIGHT (default: proportional to size); none: the embedded data.
        val_sources: validation sources (same forms); none: the embedded data's validation draw, or (with
            sources) no validation loss.
        format: the record schema of every source, or auto (detected from each record's keys).
        media_root: folder that relative image and video paths are read from (default: each data file's folder).
        streaming: stream hf: datasets instead of downloading them (exact resume re-reads the stream).
        reward: RL reward of every prompt row: choice, number, exact, ocr, grounding or html (default: from each
            row's answer and data_source).
        strict: stop at the first bad record instead of skipping it.
        max_bad_in_a_row: stop when more bad records than this come in a row.
        allow_data_change: resume even when the data differs from the checkpoint's.
        num_workers: data-loader processes building batches ahead of the training step (0: in the training process).
        seq_len: tokens per packed row.
        rows: packed rows per micro-batch.
        vision_ratio: fraction of every pre-training batch's tokens that are vision tokens (users' data: when it has
            both media and text sources); at most the vision documents' own share (their text counts too): above
            it, batches get what whole vision documents give (metrics.jsonl's `vision_tokens` shows each step's).
        tokenizer: a folder with a tokenizer (or a checkpoint) to reuse instead of training a BPE tokenizer.
        vocab_size: size of the BPE tokenizer trained on the data.
        tokenizer_texts: texts the BPE tokenizer is trained on.
        image_max_patches: patch budget per image of the checkpoint's image processor.
        video_max_patches: patch budget per video frame.
        video_fps: frames per second sampled from videos.
        families: RL task families of the embedded data: text, vision, or both as `text,vision`.
        prompts_per_step: RL prompts per rollout batch of users' data.
        prompts_per_family: RL prompts per rollout batch of each task family of the embedded data.
        video_fraction: (embedded data) share of vision documents that are videos (screencasts).
        chat_fraction: (embedded data) share of vision documents in chat form.
        code_fraction: (embedded data) share of text documents that are standard library source.
        text_chat_fraction: (embedded data) share of world text samples in chat form.
        text_tasks: (embedded data) weights of the world's text tasks, e.g. mc=3,fact=2 (default: uniform).
        vision_tasks: (embedded data) weights of the world's image tasks (default: uniform).
        video_tasks: (embedded data) weights of the world's video tasks, e.g. screencast=2,page_color=1 (default:
            screencast only).
        drill_batches: (embedded data) first batches whose text is the option-letter drill.
        drill_lookups: (embedded data) lookups per drill document.
        drill_min_options: (embedded data) fewest options of a drill question.
        drill_ramp_batches: (embedded data) first drill batches whose questions have fewer options: 2-3, then 2-6
            from half of them on (an easier start for the lookup; 0: drill_min_options to 10 from the start).
        drill_any_letters: (embedded data) a drill question of k < 10 options letters them by k of A-J drawn at
            random, not by A to the k-th letter.
        drill_vision_tasks: (embedded data) weights of the image tasks during the drill (default: vision_tasks); video
            tasks may be named too (e.g. page_color=2).
        drill_vision_ratio: (embedded data) vision ratio during the drill (default: vision_ratio).
        vit_tasks: weights of the world's image tasks the ViT stage reads labels off (`kimi_vl.training.vit`'s
            `VIT_TARGETS`: count, color, page_color, chart_bar), e.g. count=20,color=6,page_color=6.
        images_per_step: images per optimizer step of the ViT stage (split between vit_tasks by weight).
    """

    sources: list[str] = _for(*ALL, flag="--data", factory=list)
    val_sources: list[str] = _for(*PACKED, flag="--val-data", factory=list)
    format: str = _for(*ALL, default="auto")
    media_root: str | None = _for(*ALL)
    streaming: bool = _for(*ALL, default=False)
    reward: str | None = _for("rl")
    strict: bool = _for(*ALL, default=False)
    max_bad_in_a_row: int = _for(*ALL, default=100)
    allow_data_change: bool = _for(*ALL, default=False)
    num_workers: int = _for(*PACKED, default=0)
    seq_len: int = _for(*PACKED, default=256)
    rows: int = _for(*PACKED, default=4)
    vision_ratio: float | None = _for("pretrain", default=0.25)
    tokenizer: str | None = _for("pretrain")
    vocab_size: int = _for("pretrain", default=1536)
    tokenizer_texts: int = _for("pretrain", default=4000)
    image_max_patches: int = _for("vit", "pretrain", default=64)
    video_max_patches: int = _for("pretrain", default=64)
    video_fps: float = _for("pretrain", default=4.0)
    families: list[str] = _for("rl", factory=lambda: ["text", "vision"], split=",")
    prompts_per_step: int = _for("rl", default=8)
    prompts_per_family: int = _for("rl", default=8)
    video_fraction: float = _for("pretrain", default=0.1)
    chat_fraction: float = _for("pretrain", default=0.25)
    code_fraction: float = _for("pretrain", default=0.5)
    text_chat_fraction: float = _for("pretrain", default=0.0)
    text_tasks: dict[str, float] | None = _for("pretrain")
    vision_tasks: dict[str, float] | None = _for("pretrain")
    video_tasks: dict[str, float] | None = _for("pretrain")
    drill_batches: int = _for("pretrain", default=0)
    drill_lookups: int = _for("pretrain", default=5)
    drill_min_options: int = _for("pretrain", default=3)
    drill_ramp_batches: int = _for("pretrain", default=0)
    drill_any_letters: bool = _for("pretrain", default=False)
    drill_vision_tasks: dict[str, float] | None = _for("pretrain")
    drill_vision_ratio: float | None = _for("pretrain")
    vit_tasks: dict[str, float] | None = _for("vit")
    images_per_step: int = _for("vit", default=32)

    def __post_init__(self) -> None:
        if min(self.seq_len, self.rows, self.prompts_per_step, self.prompts_per_family, self.images_per_step) < 1:
            raise ConfigError(f"seq_len, rows, prompts_per_step, prompts_per_family and images_per_step must be >= 1 "
                              f"(got {self.seq_len}, {self.rows}, {self.prompts_per_step}, {self.prompts_per_family}, "
                              f"{self.images_per_step}).")
        for name in ("vision_ratio", "drill_vision_ratio", "video_fraction", "chat_fraction", "code_fraction",
                     "text_chat_fraction"):
            if (value := getattr(self, name)) is not None and not 0.0 <= value <= 1.0:  # NaN fails too
                raise ConfigError(f"{name} must be in [0, 1] (or none), got {value}.")
        if not 0.0 < self.video_fps < math.inf:
            raise ConfigError(f"video_fps must be a positive, finite frame rate, got {self.video_fps}.")
        if self.num_workers < 0 or self.max_bad_in_a_row < 0:
            raise ConfigError("num_workers and max_bad_in_a_row must be >= 0.")

    def mixture(self, sources: list[str], seed: int, kinds: tuple[str, ...]) -> Mixture:
        """The `Mixture` of `sources` (users' data) with these settings."""
        opened = [open_source(s, media_root=self.media_root, streaming=self.streaming) for s in sources]
        return Mixture(opened, seed=seed, kinds=kinds, fmt=self.format, reward=self.reward, strict=self.strict,
                       max_bad_in_a_row=self.max_bad_in_a_row)


# ----------------------------------------------------------------------------------------------------------- builders
def _embedded_pretrain(cfg: DataConfig, processor: Any, seed: int, *, drill: bool) -> PackedStream | WarmupStream:
    return embedded_pretrain_stream(
        processor, seq_len=cfg.seq_len, rows=cfg.rows, seed=seed,
        vision_ratio=cfg.vision_ratio, video_fraction=cfg.video_fraction,
        chat_fraction=cfg.chat_fraction, code_fraction=cfg.code_fraction, text_chat_fraction=cfg.text_chat_fraction,
        text_tasks=cfg.text_tasks, vision_tasks=cfg.vision_tasks, video_tasks=cfg.video_tasks,
        drill_batches=cfg.drill_batches if drill else 0,
        drill_lookups=cfg.drill_lookups, drill_min_options=cfg.drill_min_options,
        drill_ramp_batches=cfg.drill_ramp_batches, drill_any_letters=cfg.drill_any_letters,
        drill_vision_tasks=cfg.drill_vision_tasks, drill_vision_ratio=cfg.drill_vision_ratio)


VAL_SEED_OFFSET = 1_000_003
"""Validation draws of the embedded data come from a disjoint seed."""


def pretrain_data(cfg: DataConfig, processor: Any, seed: int) -> tuple[Any, Any, Mixture | None]:
    """`(train stream, validation stream or None, users' mixture or None)` of joint text-vision pre-training."""
    if not cfg.sources:
        val = _embedded_pretrain(cfg, processor, seed + VAL_SEED_OFFSET, drill=False)
        return _embedded_pretrain(cfg, processor, seed, drill=True), val, None
    kinds = ("document", "chat")
    mixture = cfg.mixture(cfg.sources, seed, kinds)
    pack = dict(seq_len=cfg.seq_len, rows=cfg.rows, vision_ratio=cfg.vision_ratio)
    train = mixture_stream(mixture, processor, seed=seed, **pack)
    val = (mixture_stream(cfg.mixture(cfg.val_sources, seed + VAL_SEED_OFFSET, kinds), processor,
                          seed=seed + VAL_SEED_OFFSET, **pack) if cfg.val_sources else None)
    return train, val, mixture


def sft_data(cfg: DataConfig, processor: Any, seed: int) -> tuple[Any, Any, Mixture | None]:
    """`(train stream, validation stream or None, users' mixture or None)` of SFT (embedded: zero-vision chats)."""
    if not cfg.sources:
        return (embedded_sft_stream(processor, seq_len=cfg.seq_len, rows=cfg.rows, seed=seed),
                embedded_sft_stream(processor, seq_len=cfg.seq_len, rows=cfg.rows, seed=seed + VAL_SEED_OFFSET),
                None)
    mixture = cfg.mixture(cfg.sources, seed, ("chat",))
    train = mixture_stream(mixture, processor, seq_len=cfg.seq_len, rows=cfg.rows, seed=seed)
    val = (mixture_stream(cfg.mixture(cfg.val_sources, seed + VAL_SEED_OFFSET, ("chat",)), processor,
                          seq_len=cfg.seq_len, rows=cfg.rows, seed=seed + VAL_SEED_OFFSET)
           if cfg.val_sources else None)
    return train, val, mixture


def data_fingerprint(mixture: Mixture | None, seed: int, *, screencasts: bool = False) -> dict[str, Any]:
    """What a checkpoint records of its data: the users' sources (`Mixture.fingerprint`) or the embedded data.
    `screencasts`: the embedded data holds screencasts (pre-training), whose frames depend on the fonts installed,
    so the font is recorded too (`screencast_font`)."""
    if mixture is not None:
        return mixture.fingerprint()
    return {"sources": [], "format": "auto", "reward": None, "seed": seed,
            **({"screencast_font": screencast_font()} if screencasts else {})}


def rl_prompts(cfg: DataConfig, seed: int, processor: Any = None) -> PromptStream | None:
    """Users' RL prompts (`PromptStream`; with the rollouts' `processor`, a prompt it cannot encode is a bad record),
    or None for the embedded world tasks."""
    if not cfg.sources:
        return None
    return PromptStream(cfg.mixture(cfg.sources, seed, ("prompt",)), cfg.prompts_per_step, processor)


__all__ = ["VAL_SEED_OFFSET", "DataConfig", "data_fingerprint", "pretrain_data", "rl_prompts", "sft_data"]
