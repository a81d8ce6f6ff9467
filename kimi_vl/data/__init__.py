"""One data layer for every stage: sources -> encode -> pack -> mix.

- Embedded sources, needing no download: the standard library corpus (`corpus`), the synthetic world (`world`),
  UI screencasts (`screencast`) and zero-vision SFT conversations (`chats`); `embedded` packs them into the default
  pre-training and SFT streams.
- `encode`: a document, a chat or an RL prompt -> token ids, labels and media tensors.
- `pack`: documents -> fixed-size rows with `cu_seqlens` and a constant vision ratio; batch `i` is a pure function
  of `(seed, i)`.
"""

from .corpus import stdlib_documents, tokenizer_texts
from .embedded import (
    drill_option_range,
    embedded_pretrain_stream,
    embedded_sft_stream,
    option_drill_document,
    stdlib_document,
)
from .encode import (
    IGNORE_INDEX,
    MEDIA_KEYS,
    Document,
    Media,
    Prompt,
    as_prompt,
    assistant_mask,
    encode_chat,
    encode_document,
    encode_prompt,
    encode_sample,
    encode_text,
    left_pad,
)
from .pack import BatchDraws, PackedBatch, PackedStream, WarmupStream
from .screencast import Screencast, make_screencast
from .world import (
    ALL_TASKS,
    TEXT_TASKS,
    VIDEO_TASKS,
    VISION_TASKS,
    Sample,
    make_sample,
    make_samples,
    mathvista_rows,
    mmlu_pro_rows,
)

__all__ = [
    "ALL_TASKS", "IGNORE_INDEX", "MEDIA_KEYS", "TEXT_TASKS", "VIDEO_TASKS", "VISION_TASKS", "BatchDraws", "Document",
    "Media", "PackedBatch", "PackedStream", "Prompt", "Sample", "Screencast", "WarmupStream", "as_prompt",
    "assistant_mask", "drill_option_range", "embedded_pretrain_stream", "embedded_sft_stream", "encode_chat",
    "encode_document", "encode_prompt", "encode_sample", "encode_text", "left_pad", "make_sample", "make_samples",
    "make_screencast", "mathvista_rows", "mmlu_pro_rows", "option_drill_document", "stdlib_document",
    "stdlib_documents", "tokenizer_texts",
]
