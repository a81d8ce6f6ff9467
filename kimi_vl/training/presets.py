"""Model + training + data presets: `tiny` (2 CPU cores, minutes; what `kimi-vl quickstart` trains) and `small` (the
single-GPU recipe). A preset holds typed settings per stage (`TrainConfig`, `DataConfig`, and `RLConfig` for RL);
`kimi_vl.training.config.resolve` applies a run's overrides to them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..data.config import DataConfig
from ..errors import ConfigError
from .rl import RLConfig
from .trainer import TrainConfig


@dataclass(frozen=True)
class Preset:
    """Everything the stages need for one model size.

    Attributes:
        name, description: the preset's name and what it is for.
        text: `KimiTextConfig` fields (the vocabulary and special-token ids come from the tokenizer).
        vision: `MoonViTConfig` fields.
        stages: the `TrainConfig` of each stage (`pretrain`, `sft`, `rl`).
        data: the `DataConfig` of each stage.
        rl_algorithm: the RL stage's `RLConfig`.
    """

    name: str
    description: str
    text: dict[str, Any]
    vision: dict[str, Any]
    stages: dict[str, TrainConfig]
    data: dict[str, DataConfig]
    rl_algorithm: RLConfig


_TINY_IMAGE_TASKS = {"count": 3, "visual_math": 4, "chart_bar": 1, "color": 1, "shape": 1, "chart_line": 0.5,
                     "ocr": 0.5, "grounding": 0.5}
# The ViT stage reads what joint pre-training never taught the tower: counts (the tower alone: 70% / 85% of held-out
# scenes after 1000 / 2000 steps of 32), and beside them the colours the proxies and the demo ask about (a shape's,
# a page's header and first section: 99-100% within the same 1500 steps, the count at 79%). Bar charts beside them
# taught the tallest bar (41%) but no language model used that: the proxy's bar questions name their bars by
# printed labels, which neither reads (docs/RESULTS.md, "ViT training").
_VIT_TASKS = {"count": 20, "color": 6, "page_color": 6}
_TINY_MEDIA = dict(vocab_size=1536, tokenizer_texts=4000, image_max_patches=64, video_max_patches=64, video_fps=4.0)
# 4 rows of 4096 tokens per micro-batch: 16 rows OOMed an H200 (139 GiB) at the first backward (docs/RESULTS.md,
# "On a GPU"); gradient accumulation keeps the optimizer step's tokens (pre-training 131072, SFT 65536)
_SMALL_PACKING = dict(seq_len=4096, rows=4)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description="~1.4M parameters; the quickstart model (2 CPU cores, minutes)",
        text=dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=72, num_hidden_layers=4,
                  num_attention_heads=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  num_experts=4, num_experts_per_tok=2, kda_head_dim=16, kda_num_heads=8, attnres_block_size=2),
        vision=dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128,
                    pos_emb_height=16, pos_emb_width=16),
        stages={
            "vit": TrainConfig(steps=1500, lr=2e-3, warmup_steps=20, checkpoint_every=250),  # 2.5 min
            # the tower at a tenth of the rate: at the full rate Muon's updates erased the ViT stage's counting
            # (a probe on the tower: 79% -> 26%, every reply "5"); at 0.1 it keeps 68% and the proxy counts (val
            # items, seed 0: 68% of counting questions, MathVista proxy 27% vs 6% without the stage); at 0.3 it
            # keeps 56% and costs text (MMLU-Pro proxy 74% vs 80%). A count-only tower, frozen or at 0.1, lost the
            # colours joint pre-training would have taught it (25%); the ViT stage's colour targets keep them (97%)
            "pretrain": TrainConfig(steps=2000, lr=3e-3, warmup_steps=20, checkpoint_every=50, val_every=400,
                                    vision_lr_scale=0.1),
            # lr 5e-4: text-only SFT unlearns reading images the faster the higher its rate (teacher-forced colour,
            # val items: 96% -> 41% at 2e-3 on one seed; 99 / 76 / 55% at 1e-3 on three seeds whose pre-training
            # reads 98-99%; 99 / 94 / 83% at 5e-4, for 0.2 MMLU-Pro proxy points on the mean; docs/RESULTS.md)
            "sft": TrainConfig(steps=500, lr=5e-4, warmup_steps=10, checkpoint_every=100),
            # lr 1e-4 with 8 prompts per family (was 2e-4 with 4): at 2e-4 text-only RL broke the reply's final copy
            # of the option letter on 3 of 24 fresh seeds (val text proxy 49-61%, SD 4.7 points); with twice the
            # prompts at half the rate none of 24 fell below 65.7% (SD 1.5; docs/RESULTS.md)
            "rl": TrainConfig(steps=20, lr=1e-4, weight_decay=0.0, warmup_steps=0, decay_fraction=0.0,
                              checkpoint_every=10),
        },
        # 8 rows of 256 tokens, 15% vision tokens after the drill (10% in it), half the vision documents videos:
        # with their questions and replies the vision documents fill about 60% of a batch, and a 4-row batch at 30%
        # vision gave them 88%, leaving the text 111 loss tokens per batch against 488 at the former 4 rows and 10%:
        # the demo's pages then stated the video's colours but the text proxy was lost (12.9%). Twice the rows give
        # both: about 600 text and 630 vision-document loss tokens per batch; the pages state the colours of their
        # videos (one-colour videos, `page_swatch`, and element colours, `page_color`, teach where to read) and the
        # text proxy holds, for twice the time per step (docs/RESULTS.md, "Video to website").
        # The world's questions dominate the text (the proxies' skills: facts, reading the question, finding an
        # option's letter), half of them as chats (loss on the answer only); the image tasks the MathVista proxy
        # asks about (counting, bar charts, visual math) dominate the vision documents, and 64-patch images give
        # more of them per batch. The first 450 batches' text is the option-letter drill (see
        # `embedded_pretrain_stream`); its first 300 batches ask about 2-3 options, then 2-6 (with 3-10 from the
        # start the lookup was learned on two seeds of four, with the ramp on every seed tried on one machine but
        # missed on 3 runs of 11 on another). Their options are lettered by any of A-J (`drill_any_letters`): lettered
        # A, B, C the few-option questions let a run settle on those letters' frequencies and miss the lookup; so
        # lettered, 23 probed runs of 24 were off chance by the drill's end (the two that had missed included).
        # One-colour images (`swatch`: every image token carries the answer) teach the language model to read image
        # tokens within tens of steps, where shapes among background tokens alone take hundreds; learned early, the
        # reading carries over to shapes. In the drill they are a small share (weight 1: at weight 3 their documents
        # crowd out the drill and the letter skill is not learned), after it a larger one. Learned only after the drill,
        # swatches are read but shapes' colours are not (docs/RESULTS.md). Unit conversions come as free-form
        # questions too (`units`, half of their quantities 10-99): asked only in `mc` questions, with quantities 2-9,
        # a run could recall a quantity met with the wording instead of copying the question's (30 of the 31
        # conversions three seeds got wrong); with `units` the validation text proxy rose from 64.8% to 74.0%.
        data={
            "vit": DataConfig(image_max_patches=_TINY_MEDIA["image_max_patches"], images_per_step=32,
                              vit_tasks=_VIT_TASKS),
            "pretrain": DataConfig(seq_len=256, rows=8, **_TINY_MEDIA, vision_ratio=0.15, code_fraction=0.05,
                                   chat_fraction=0.5, text_chat_fraction=0.5,
                                   text_tasks={"mc": 3, "fact": 2, "arithmetic": 1, "units": 1, "lookup": 4},
                                   vision_tasks={**_TINY_IMAGE_TASKS, "swatch": 3},
                                   drill_batches=450, drill_lookups=10, drill_ramp_batches=300, drill_any_letters=True,
                                   drill_vision_tasks={**_TINY_IMAGE_TASKS, "swatch": 1}, drill_vision_ratio=0.1,
                                   video_fraction=0.5,
                                   video_tasks={"screencast": 1, "page_color": 0.5, "page_swatch": 0.5}),
            # 512-token rows: a page conversation (about 265 tokens) is placed whole, its closing tags in context
            "sft": DataConfig(seq_len=512, rows=2),
            "rl": DataConfig(prompts_per_family=8),
        },
        # two optimizer steps per rollout batch: the second acts on a log-ratio, so K2.5's token mask and penalty
        # act (off-policy, as K2.5 trains); 20 optimizer steps are then 10 rollout batches
        rl_algorithm=RLConfig(k=4, max_new_tokens=40, updates_per_batch=2),
    ),
    "small": Preset(
        name="small",
        description="~400M total parameters (16 experts, top-2); the single-GPU recipe (bf16, one 80 GB GPU)",
        text=dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=16,
                  num_attention_heads=12, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64,
                  v_head_dim=64, num_experts=16, num_experts_per_tok=2, num_shared_experts=1, kda_head_dim=64,
                  kda_num_heads=12, first_k_dense=1),
        vision=dict(hidden_size=384, num_attention_heads=6, num_hidden_layers=8, intermediate_size=1536,
                    pos_emb_height=64, pos_emb_width=64),
        stages={
            "vit": TrainConfig(steps=5000, lr=1e-3, warmup_steps=200, checkpoint_every=500),
            "pretrain": TrainConfig(steps=20_000, lr=2e-3, warmup_steps=500, grad_accum=8, checkpoint_every=1000,
                                    val_every=1000),
            "sft": TrainConfig(steps=2000, lr=5e-4, warmup_steps=100, grad_accum=4, checkpoint_every=500),
            "rl": TrainConfig(steps=500, lr=1e-5, weight_decay=0.0, warmup_steps=10, checkpoint_every=50),
        },
        data={
            "vit": DataConfig(image_max_patches=1024, images_per_step=256, vit_tasks=_VIT_TASKS),
            "pretrain": DataConfig(**_SMALL_PACKING, vocab_size=32768, tokenizer_texts=200_000, image_max_patches=1024,
                                   video_max_patches=2048, video_fps=2.0, vision_ratio=0.25, num_workers=4),
            "sft": DataConfig(**_SMALL_PACKING, num_workers=4),
            "rl": DataConfig(prompts_per_family=32),
        },
        rl_algorithm=RLConfig(k=8, max_new_tokens=512),
    ),
}


CPU_PRESETS = ("tiny",)
"""The presets meant for a CPU; the others are GPU recipes."""


def warn_without_cuda(preset: str) -> None:
    """Warn (UserWarning) when the GPU recipe `preset` is about to run without a CUDA device: days on the CPU."""
    if preset not in CPU_PRESETS and not torch.cuda.is_available():
        warnings.warn(f"preset {preset!r} is a GPU recipe and no CUDA device is visible: on the CPU its full run takes "
                      "days. `--preset tiny` is the CPU recipe; fewer `--steps` (the quickstart's `--scale`) make a "
                      "trial run.", UserWarning, stacklevel=3)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]
