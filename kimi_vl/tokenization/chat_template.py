"""Kimi's chat format as a Jinja chat template (`CHAT_TEMPLATE`) and small helpers to render prompts without a
tokenizer.

Format (no newlines between turns, nothing between the role header and the content):

    <|im_system|>system<|im_middle|>{system}<|im_end|>                  only when a system message is given
    <|im_user|>user<|im_middle|>{content parts in order}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{answer}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                               add_generation_prompt=True

Content is a string (verbatim) or a list of parts in transformers' multimodal schema:
- `{"type": "text", "text": ...}`: the text, verbatim;
- `{"type": "image", ...}` (with `image`, `url`, `path` or `base64`; OpenAI `image_url` parts are converted to it
  by transformers): `<|media_start|>image<|media_content|><|media_pad|><|media_end|>`; the processor expands the
  one `<|media_pad|>` into one per merged image token;
- `{"type": "video", ...}` (with `video`, `url` or `path`): `<|kimi_k25_video_placeholder|>`, which the processor
  expands into one `<|media_start|>video<|media_content|>...<|media_end|>` block per temporal chunk, each preceded
  by the chunk's timestamp.
Message text is tokenized as any text is: a special-token string in it (a user typing `<|im_end|>`) becomes that token,
as with transformers' templates; `apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)` keeps such
strings text.
Roles: `system`, `user`, `assistant`, and `tool` (rendered as `<|im_system|>tool<|im_middle|>...`, as in Kimi's
template); any other role, or an unknown part type, is an error, and so is anything the format has no place for
and would drop: assistant `tool_calls`, `reasoning_content`, and `apply_chat_template(..., tools=...)` or
`documents=...`. The text of assistant turns and their `<|im_end|>` are wrapped in `{% generation %}` (their images and
videos are input, as in `kimi_vl.data.encode_chat`) so `return_assistant_tokens_mask=True` marks exactly the tokens to
train on.

Default system prompt: none. Released Kimi-VL models were trained with `<|im_system|>system<|im_middle|>You are a
helpful assistant<|im_end|>` prepended when a conversation has no system message; models trained with this package
see exactly the messages they are given (no hidden tokens in every sample). To reproduce the released behaviour pass
the template variable `default_system_prompt=KIMI_DEFAULT_SYSTEM_PROMPT` to `apply_chat_template` (or to
`render_chat`): it is used only when the first message is not a system message.
"""

from __future__ import annotations

from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from .special_tokens import (
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    MEDIA_START,
    VIDEO_PLACEHOLDER,
)

KIMI_DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant"
"""The system prompt released Kimi-VL checkpoints add when a conversation has none (opt-in here)."""

IMAGE_PROMPT = f"{MEDIA_START}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"
"""What one image part renders to (before the processor expands `<|media_pad|>`)."""

VIDEO_PROMPT = VIDEO_PLACEHOLDER
"""What one video part renders to (the processor expands it into per-chunk media blocks)."""

ASSISTANT_HEADER = f"{IM_ASSISTANT}assistant{IM_MIDDLE}"
"""The generation prompt: the header of an assistant turn."""

# Written one statement per line for reading; the lines are stripped and joined (so the template itself contains no
# newlines) and every tag trims whitespace. No literal text spans two lines.
_TEMPLATE_LINES = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}
                IMAGE_PROMPT
            {%- elif part['type'] == 'video' -%}
                VIDEO_PROMPT
            {%- else -%}
                {{- raise_exception('Unsupported content part type ' ~ part['type'] ~ ': use text, image or video.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools is defined and tools -%}
    {{- raise_exception('tools are not supported by this chat template: Kimi-VL has no tool-declaration format; ' ~
                        'describe the tools in the system message.') -}}
{%- endif -%}
{%- if documents is defined and documents -%}
    {{- raise_exception('documents are not supported by this chat template: Kimi-VL has no retrieval-document ' ~
                        'format; put the documents in the system or user message.') -}}
{%- endif -%}
{%- if default_system_prompt is defined and default_system_prompt -%}
    {%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
        IM_SYSTEMsystemIM_MIDDLE{{- default_system_prompt -}}IM_END
    {%- endif -%}
{%- endif -%}
{%- for message in messages -%}
    {%- set role = message['role'] -%}
    {%- set content = message['content'] if message['content'] is defined and message['content'] is not none else '' -%}
    {%- if role == 'system' -%}
        IM_SYSTEMsystemIM_MIDDLE{{- render_content(content) -}}IM_END
    {%- elif role == 'user' -%}
        IM_USERuserIM_MIDDLE{{- render_content(content) -}}IM_END
    {%- elif role == 'assistant' -%}
        {%- if message['tool_calls'] is defined and message['tool_calls'] -%}
            {{- raise_exception('Assistant tool_calls are not supported by this chat template (they would be ' ~
                                'dropped): write the call into the content.') -}}
        {%- endif -%}
        {%- if message['reasoning_content'] is defined and message['reasoning_content'] -%}
            {{- raise_exception('Assistant reasoning_content is not supported by this chat template (it would be ' ~
                                'dropped): put the reasoning in the content, as the Kimi thinking models do ' ~
                                '(◁think▷...◁/think▷).') -}}
        {%- endif -%}
        ASSISTANT_HEADER
        {%- if content is string -%}
            {%- generation -%}{{- content -}}{%- endgeneration -%}
        {%- else -%}
            {%- for part in content -%}
                {%- if part is string or part['type'] == 'text' -%}
                    {%- generation -%}{{- render_content([part]) -}}{%- endgeneration -%}
                {%- else -%}
                    {{- render_content([part]) -}}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {%- generation -%}IM_END{%- endgeneration -%}
    {%- elif role == 'tool' -%}
        IM_SYSTEMtoolIM_MIDDLE{{- render_content(content) -}}IM_END
    {%- else -%}
        {{- raise_exception('Unsupported role ' ~ role ~ ': use system, user, assistant or tool.') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    ASSISTANT_HEADER
{%- endif -%}
"""


def _build_template() -> str:
    text = "".join(line.strip() for line in _TEMPLATE_LINES.splitlines())
    # The upper-case names stand for token strings; no name occurs inside another name or inside a value.
    for name, value in (
        ("ASSISTANT_HEADER", ASSISTANT_HEADER),
        ("IMAGE_PROMPT", IMAGE_PROMPT),
        ("VIDEO_PROMPT", VIDEO_PROMPT),
        ("IM_SYSTEM", IM_SYSTEM),
        ("IM_MIDDLE", IM_MIDDLE),
        ("IM_USER", IM_USER),
        ("IM_END", IM_END),
    ):
        text = text.replace(name, value)
    return text


CHAT_TEMPLATE: str = _build_template()
"""Kimi's chat template (Jinja), attached to tokenizers made by `build_tokenizer` and to `KimiVLProcessor`."""


def render_chat(
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    default_system_prompt: str | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> str:
    """Render one conversation to the prompt string (media as unexpanded placeholders), without a tokenizer.

    Same result as `tokenizer.apply_chat_template(messages, tokenize=False, ...)` with `CHAT_TEMPLATE`.
    """
    kwargs = {} if default_system_prompt is None else {"default_system_prompt": default_system_prompt}
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=chat_template, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return rendered[0]


def render_chat_spans(
    messages: list[dict[str, Any]], *, chat_template: str = CHAT_TEMPLATE
) -> tuple[str, list[tuple[int, int]]]:
    """`render_chat(messages)` and the character ranges `(start, end)` of the template's `{% generation %}` blocks, in
    order (with `CHAT_TEMPLATE`: the assistant replies' text and their `<|im_end|>`, what
    `apply_chat_template(..., return_assistant_tokens_mask=True)` marks); none for a template without such blocks."""
    rendered, spans = render_jinja_template(conversations=[messages], chat_template=chat_template,
                                            return_assistant_tokens_mask=True)
    return rendered[0], [tuple(span) for span in spans[0]]


__all__ = [
    "ASSISTANT_HEADER",
    "CHAT_TEMPLATE",
    "IMAGE_PROMPT",
    "KIMI_DEFAULT_SYSTEM_PROMPT",
    "VIDEO_PROMPT",
    "render_chat",
    "render_chat_spans",
]
