"""Kimi's special tokens: their strings, in id order (`SPECIAL_TOKENS`), and the roles the tokenizer, the chat template,
the processor and the data layer give them. One module that `tokenizer` and `chat_template` both import.

Token roles: `[BOS]` starts a pre-training document (nothing adds it automatically), `[EOS]` (`DOC_EOS`) ends one,
`<|im_end|>` ends a chat turn (the tokenizer's eos token: generation stops there), `[PAD]` pads, the `<|im_*|>`
tokens frame chat turns, `<|media_start|>` / `<|media_content|>` / `<|media_end|>` frame a media block, and
`<|media_pad|>` / `<|kimi_k25_video_placeholder|>` are the image and video placeholders the fusion replaces.
"""

BOS = "[BOS]"
DOC_EOS = "[EOS]"
PAD = "[PAD]"
IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
MEDIA_START = "<|media_start|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
"""Stands for one whole video in a rendered chat; the processor expands it into per-chunk media blocks (the same
string as transformers' `Kimi_K25Processor`)."""

SPECIAL_TOKENS: tuple[str, ...] = (
    BOS,
    DOC_EOS,
    PAD,
    IM_END,
    IM_USER,
    IM_ASSISTANT,
    IM_SYSTEM,
    IM_MIDDLE,
    MEDIA_START,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    VIDEO_PLACEHOLDER,
)
"""Every special token, in id order (ids 0 .. 12 of a tokenizer made by `build_tokenizer`)."""
