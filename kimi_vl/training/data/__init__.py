"""Embedded, download-free training data: the standard library corpus, the synthetic world (text, image and
screencast tasks), document encoding and packing into `cu_seqlens` batches, and zero-vision SFT conversations."""

from .corpus import stdlib_documents, tokenizer_texts
from .packing import (
    Document,
    PackedBatch,
    PackedStream,
    encode_chat,
    encode_sample,
    encode_text,
    pretrain_stream,
    sft_stream,
)
from .screencast import Screencast, make_screencast
from .sft import sft_conversation, sft_conversations
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
    "ALL_TASKS",
    "TEXT_TASKS",
    "VIDEO_TASKS",
    "VISION_TASKS",
    "Document",
    "PackedBatch",
    "PackedStream",
    "Sample",
    "Screencast",
    "encode_chat",
    "encode_sample",
    "encode_text",
    "make_sample",
    "make_samples",
    "make_screencast",
    "mathvista_rows",
    "mmlu_pro_rows",
    "pretrain_stream",
    "sft_conversation",
    "sft_conversations",
    "sft_stream",
    "stdlib_documents",
    "tokenizer_texts",
]
