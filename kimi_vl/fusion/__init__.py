"""Early fusion of vision and text: Kimi's special tokens, the byte-level BPE tokenizer builder and the chat
template (prompt format)."""

from .chat_template import (
    ASSISTANT_HEADER,
    CHAT_TEMPLATE,
    IMAGE_PROMPT,
    KIMI_DEFAULT_SYSTEM_PROMPT,
    VIDEO_PROMPT,
    render_chat,
)
from .tokenizer import (
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
    MIN_VOCAB_SIZE,
    PAD,
    SPECIAL_TOKENS,
    VIDEO_PLACEHOLDER,
    build_tokenizer,
)

__all__ = [
    "ASSISTANT_HEADER",
    "BOS",
    "CHAT_TEMPLATE",
    "DOC_EOS",
    "IMAGE_PROMPT",
    "IM_ASSISTANT",
    "IM_END",
    "IM_MIDDLE",
    "IM_SYSTEM",
    "IM_USER",
    "KIMI_DEFAULT_SYSTEM_PROMPT",
    "MEDIA_CONTENT",
    "MEDIA_END",
    "MEDIA_PAD",
    "MEDIA_START",
    "MIN_VOCAB_SIZE",
    "PAD",
    "SPECIAL_TOKENS",
    "VIDEO_PLACEHOLDER",
    "VIDEO_PROMPT",
    "build_tokenizer",
    "render_chat",
]
