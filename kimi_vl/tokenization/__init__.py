"""Tokenization: Kimi's special tokens (`special_tokens`), the byte-level BPE tokenizer builder (`tokenizer`) and
the chat template, the prompt format (`chat_template`)."""

from .chat_template import (
    ASSISTANT_HEADER,
    CHAT_TEMPLATE,
    IMAGE_PROMPT,
    KIMI_DEFAULT_SYSTEM_PROMPT,
    VIDEO_PROMPT,
    render_chat,
)
from .special_tokens import (
    BOS,
    DOC_EOS,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    MEDIA_START,
    PAD,
    SPECIAL_TOKENS,
    VIDEO_PLACEHOLDER,
)
from .tokenizer import MIN_VOCAB_SIZE, build_tokenizer

__all__ = [
    "ASSISTANT_HEADER", "BOS", "CHAT_TEMPLATE", "DOC_EOS", "IMAGE_PROMPT", "IM_ASSISTANT", "IM_END", "IM_MIDDLE",
    "IM_SYSTEM", "IM_USER", "KIMI_DEFAULT_SYSTEM_PROMPT", "MEDIA_CONTENT", "MEDIA_END", "MEDIA_PAD", "MEDIA_START",
    "MIN_VOCAB_SIZE", "PAD", "SPECIAL_TOKENS", "VIDEO_PLACEHOLDER", "VIDEO_PROMPT", "build_tokenizer", "render_chat",
]
