"""Encoding: a document, a chat or an RL prompt -> token ids, labels and the processor's media tensors.

Documents (`Document`): token ids + labels (-100 where there is no loss) + the processed media they hold.
- `encode_text(text, tokenizer)`: `[BOS] text [EOS]`, loss on every token after `[BOS]`; special-token strings
  inside the text stay plain text (they are never turned into control tokens). Splittable: it may be cut anywhere.
- `encode_document(segments, processor)`: an interleaved document, `[BOS]`, then its segments in order (text, or an
  image / a video as `Media`), then `[EOS]`. Text segments are tokenized as plain text (special-token strings stay
  text) and carry the loss; each image becomes one block `<|media_start|>image<|media_content|><|media_pad|>x N
  <|media_end|>`, each video one `HH:MM:SS.mmm<|media_start|>video<|media_content|>...<|media_end|>` block per
  temporal chunk, all without loss. Not splittable when it holds media.
- `encode_sample(sample, processor, chat=False)`, the pre-training form of a world sample: `encode_document` of its
  media followed by `Question: ...\\nAnswer: ...` (`world.sample_text`).
- `encode_sample(sample, processor, chat=True)` / `encode_chat(messages, processor)`: Kimi's chat format (the
  processor's chat template); loss only on assistant turns: their content and their closing `<|im_end|>`, not
  on the `<|im_assistant|>assistant<|im_middle|>` header nor on system / user / tool turns.
Media documents carry the processor's tensors (`pixel_values` `[patches, 3, 14, 14]`, `image_grid_thw` `[images,
3]`, `pixel_values_videos`, `video_grid_thw` `[chunks, 3]`) in `Document.media`.

RL prompts: `encode_prompt(prompt, processor)` renders `prompt.messages` with the generation prompt (the assistant
header) and returns `(ids [L], media)`; `left_pad` stacks several into a left-padded batch for `generate`.

Media values (in chat parts, `Media` segments and prompts) are decoded images (PIL or uint8 arrays), videos as
frame sequences (`[T, H, W, 3]` arrays, lists of frames, or objects with `frames` and `fps` such as a
`Screencast`, or `VideoFrames` sampled by `load_video`, timed by their source frames), or, for videos only, local file
paths (read with decord by the video processor). Frames without a rate are taken as sampled at the video processor's
`fps` (their chunk timestamps follow from it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, InvalidMediaError, ShapeError
from ..processing import _base64_as_data_uri
from ..tokenization.chat_template import CHAT_TEMPLATE, IMAGE_PROMPT, VIDEO_PROMPT, render_chat, render_chat_spans
from ..tokenization.special_tokens import BOS, DOC_EOS, IM_ASSISTANT, IM_END, IM_MIDDLE, MEDIA_END, MEDIA_START
from ..vision.media import VideoFrames
from ..vision.video_processing import TimedVideoMetadata, clip_metadata
from .world import Sample, sample_text

IGNORE_INDEX = -100
MEDIA_KEYS: tuple[str, ...] = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""Model inputs that carry media (concatenated over documents / rows in order)."""


@dataclass
class Document:
    """One training document before packing.

    Attributes:
        input_ids: token ids, length T.
        labels: length T; the token id where the token is a target of the loss, -100 elsewhere.
        images: source images (PIL), in placeholder order (kept for reference; packing uses `media`).
        videos: source videos (`Screencast`, frame arrays or paths), in placeholder order.
        media: the processor's tensors for those media: `pixel_values`, `image_grid_thw`, `pixel_values_videos`,
            `video_grid_thw` (only the keys present).
        splittable: the document may be cut at any token (plain text); otherwise it is placed whole when it fits
            in a row.
        source: name of the data source it was drawn from ("" for documents not drawn from a named source).
    """

    input_ids: list[int]
    labels: list[int]
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    splittable: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ShapeError(f"a Document has {len(self.input_ids)} input_ids but {len(self.labels)} labels; give "
                             "one label per token (-100 where there is no loss).")

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Media:
    """An image or a video inside an interleaved document (`encode_document`): `kind` is "image" or "video",
    `value` the decoded media (see the module docstring)."""

    kind: str
    value: Any


# ------------------------------------------------------------------------------------------------------ token helpers
def tokenizer_of(processor_or_tokenizer: Any) -> Any:
    """The tokenizer of a `KimiVLProcessor`, or the argument itself when it is a tokenizer."""
    return getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)


def special_ids(tokenizer: Any, tokens: Sequence[str]) -> list[int]:
    """Ids of special `tokens` (`ConfigError` when the tokenizer lacks one)."""
    tok = tokenizer_of(tokenizer)
    ids = tok.convert_tokens_to_ids(list(tokens))
    unk = getattr(tok, "unk_token_id", None)
    missing = [t for t, i in zip(tokens, ids) if i is None or (unk is not None and i == unk)]
    if missing:
        raise ConfigError(f"the tokenizer lacks the special tokens {missing}; build it with "
                          "kimi_vl.tokenization.build_tokenizer.")
    return ids


def plain_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as plain text: special-token strings in it are tokenized as ordinary characters."""
    return tokenizer_of(tokenizer)(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def end_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end a generated reply: `<|im_end|>`, `[EOS]` and the tokenizer's eos token (those it has)."""
    tok = tokenizer_of(tokenizer)
    ids = []
    for token in (IM_END, DOC_EOS):
        i = tok.convert_tokens_to_ids(token)
        if isinstance(i, int) and i != getattr(tok, "unk_token_id", None) and i >= 0:
            ids.append(i)
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    if not ids:
        raise ConfigError("the tokenizer has no end token (<|im_end|>); build it with "
                          "kimi_vl.tokenization.build_tokenizer.")
    return ids


# -------------------------------------------------------------------------------------------------------------- media
def is_video_file(video: Any) -> bool:
    """Whether `video` is a file path (`str`, `bytes` or `os.PathLike`), which the video processor reads with decord."""
    return isinstance(video, (str, bytes)) or hasattr(video, "__fspath__")


def video_inputs(videos: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Processor inputs for `videos`: decoded frames `[T, H, W, 3]` with `video_metadata` (exact timestamps; a
    `VideoFrames` clip's from its source indices and times, `clip_metadata`) for frame sequences and objects with
    `frames` (and `fps`), paths as they are (all videos must then be paths)."""
    if all(is_video_file(v) for v in videos):
        return list(videos), {}
    arrays, metadata = [], []
    for v in videos:
        if isinstance(v, VideoFrames):
            arrays.append(v.frames)
            metadata.append(clip_metadata(v))
            continue
        if hasattr(v, "frames"):
            frames, fps = v.frames, getattr(v, "fps", None)
        elif isinstance(v, (list, tuple, np.ndarray, torch.Tensor)):
            frames, fps = v, None
        else:
            raise InvalidMediaError(f"a video of type {type(v).__name__} cannot be used here; pass a Screencast, "
                                    "a list of frames, a [T, H, W, 3] array, or (for all videos) file paths.")
        array = np.stack([np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8)
                          for f in frames])
        arrays.append(array)
        metadata.append(TimedVideoMetadata(total_num_frames=int(array.shape[0]), fps=float(fps) if fps else None))
    return arrays, {"video_metadata": metadata, "do_sample_frames": False}


def process(processor: Any, text: str, images: Sequence[Any] = (), videos: Sequence[Any] = (),
            **kwargs: Any) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of `text` (special tokens recognised, media placeholders expanded) and the media tensors. Video
    files among decoded videos are read as the video processor reads files (`MoonViTVideoProcessor.read_video`:
    sampled by its `fps` or `num_frames`, at most `max_frames`), then all go to it as timed frames."""
    ids, media, _ = _process(processor, text, images, videos, offsets=False, **kwargs)
    return ids, media


def _process(processor: Any, text: str, images: Sequence[Any], videos: Sequence[Any], *, offsets: bool,
             **kwargs: Any) -> tuple[list[int], dict[str, torch.Tensor], list[tuple[int, int]] | None]:
    """`process`, and with `offsets` each token's character range `(start, end)` in `text` (the tokens an expanded
    media placeholder became get the placeholder's range; None without `offsets`). Offsets need a fast tokenizer."""
    if not images and not videos:
        out = tokenizer_of(processor)(text, add_special_tokens=False, return_offsets_mapping=offsets)
        return out["input_ids"], {}, [tuple(o) for o in out["offset_mapping"]] if offsets else None
    if processor is tokenizer_of(processor):
        raise ConfigError("the text has images or videos: pass a KimiVLProcessor (not a bare tokenizer).")
    if videos:
        video_processor = getattr(processor, "video_processor", None)
        if not all(is_video_file(v) for v in videos):  # files among decoded videos: read as the processor reads them
            videos = [video_processor.read_video(os.fsdecode(v), **kwargs) if is_video_file(v) else v for v in videos]
        frames, video_kwargs = video_inputs(videos)
        fps = getattr(video_processor, "fps", None)
        for meta in video_kwargs.get("video_metadata", []):  # frames without a rate: sampled at the processor's
            if meta.fps is None:
                meta.fps = fps
        kwargs = {**video_kwargs, **kwargs}
    else:
        frames = None
    if offsets:
        kwargs = {**kwargs, "return_offsets_mapping": True, "return_text_replacement_offsets": True}
    out = processor(text=text, images=list(images) or None, videos=frames, **kwargs)
    ids = out["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    media = {k: torch.as_tensor(out[k]) for k in MEDIA_KEYS if out.get(k) is not None}
    if not offsets:
        return list(ids[0]), media, None
    # From the expanded text back to `text`, in one pass (token offsets and replacements both in text order): past a
    # replacement, positions are `new_end - old_end` chars later; a token inside one gets the placeholder's range.
    replacements = sorted(out["text_replacement_offsets"][0], key=lambda r: r["new_span"][0])
    ranges, k, shift = [], 0, 0
    for start, end in out["offset_mapping"][0]:
        while k < len(replacements) and start >= replacements[k]["new_span"][1]:
            shift = replacements[k]["new_span"][1] - replacements[k]["span"][1]
            k += 1
        if k < len(replacements) and end > replacements[k]["new_span"][0]:
            ranges.append(tuple(int(x) for x in replacements[k]["span"]))
        else:
            ranges.append((int(start) - shift, int(end) - shift))
    return list(ids[0]), media, ranges


def message_media(messages: Sequence[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """The images and videos of a conversation's content parts, in order (an image under `image`, `path`, `url`,
    `base64` or OpenAI's `image_url`, as `apply_chat_template` reads them)."""
    images, videos = [], []
    for m in _base64_as_data_uri(list(messages)):
        content = m.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in ("image", "image_url"):
                source = next((part[k] for k in ("image", "path", "url", "base64", "image_url")
                               if part.get(k) is not None), None)
                if isinstance(source, dict):  # OpenAI's {"type": "image_url", "image_url": {"url": ...}}
                    source = source.get("url")
                if source is None:
                    raise InvalidMediaError("an image part has no image; give it under 'image' (PIL image or "
                                            "array), 'path', 'url' or 'base64'.")
                images.append(source)
            elif kind == "video":
                source = next((part[k] for k in ("video", "path", "url") if part.get(k) is not None), None)
                if source is None:
                    raise InvalidMediaError("a video part has no video; give it under 'video' (Screencast or "
                                            "frames) or 'path'.")
                videos.append(source)
    return images, videos


# ---------------------------------------------------------------------------------------------------------- documents
def encode_text(text: str, tokenizer: Any) -> Document:
    """A plain language-modelling document `[BOS] text [EOS]` (labels: -100 on `[BOS]`, the ids elsewhere).

    `tokenizer` may be a tokenizer or a `KimiVLProcessor`. Special-token strings in `text` are tokenized as
    plain text. The document is splittable.
    """
    bos, eos = special_ids(tokenizer, (BOS, DOC_EOS))
    ids = [bos, *plain_ids(tokenizer, text), eos]
    return Document(ids, [IGNORE_INDEX, *ids[1:]], splittable=True)


def encode_document(segments: Sequence[str | Media], processor: Any) -> Document:
    """An interleaved pre-training document: `[BOS]`, each segment (text with loss; an image or video block
    without loss), `[EOS]` (with loss). Without media it is `encode_text` of the joined text (splittable)."""
    if not any(isinstance(s, Media) for s in segments):
        return encode_text("".join(segments), processor)
    bos, eos = special_ids(processor, (BOS, DOC_EOS))
    ids, labels = [bos], [IGNORE_INDEX]
    images, videos, media_parts = [], [], []
    for seg in segments:
        if isinstance(seg, Media):
            if seg.kind not in ("image", "video"):
                raise ConfigError(f"a media segment has kind {seg.kind!r}; use 'image' or 'video'.")
            image = seg.kind == "image"
            block, media = process(processor, IMAGE_PROMPT if image else VIDEO_PROMPT,
                                   [seg.value] if image else [], [] if image else [seg.value])
            (images if image else videos).append(seg.value)
            media_parts.append(media)
            ids += block
            labels += [IGNORE_INDEX] * len(block)
        elif seg:
            text_ids = plain_ids(processor, seg)
            ids += text_ids
            labels += text_ids
    ids.append(eos)
    labels.append(eos)
    merged = {k: torch.cat([m[k] for m in media_parts if k in m]) for k in MEDIA_KEYS
              if any(k in m for m in media_parts)}
    return Document(ids, labels, images, videos, merged, splittable=False)


def assistant_mask(input_ids: Sequence[int], tokenizer: Any) -> list[bool]:
    """True on the tokens of assistant turns that are trained on: each turn's content after
    `<|im_assistant|>...<|im_middle|>` up to and including its `<|im_end|>`."""
    header, middle, end = special_ids(tokenizer, (IM_ASSISTANT, IM_MIDDLE, IM_END))
    mask = [False] * len(input_ids)
    state = "outside"  # outside -> header (after <|im_assistant|>) -> content (after its <|im_middle|>)
    for i, t in enumerate(input_ids):
        if state == "outside":
            if t == header:
                state = "header"
        elif state == "header":
            if t == middle:
                state = "content"
        else:
            mask[i] = True
            if t == end:
                state = "outside"
    return mask


def _chat_template(processor: Any) -> str:
    return (getattr(processor, "chat_template", None) or getattr(tokenizer_of(processor), "chat_template", None)
            or CHAT_TEMPLATE)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ConfigError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    return list(messages)


def _overlaps(ranges: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """For each of `ranges` (token character ranges, in text order), whether it overlaps one of `spans` (disjoint,
    in text order), in one pass over both."""
    out, k = [], 0
    for start, end in ranges:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        out.append(k < len(spans) and spans[k][0] < end)
    return out


def encode_chat(messages: list[dict[str, Any]], processor: Any) -> Document:
    """A conversation in Kimi's chat format with loss on the assistant turns only (their content and closing
    `<|im_end|>`; a media block in one, `<|media_start|>` to `<|media_end|>`, is input, without loss). Media parts
    (`{"type": "image", "image": PIL}`, `{"type": "video", "video": Screencast}`) are expanded by the processor."""
    messages = _check_messages(messages)
    images, videos = message_media(messages)
    # The assistant turns' character spans, as the template's {% generation %} blocks mark them (what
    # `apply_chat_template(..., return_assistant_tokens_mask=True)` and TRL's assistant-only loss use): unlike the
    # token ids, they tell the template's turn markers from special-token strings inside a message's text.
    # Without spans or offsets (a template without {% generation %}, such as the released Kimi one; a slow
    # tokenizer) `assistant_mask` reads the ids.
    text, spans = render_chat_spans(messages, chat_template=_chat_template(processor))
    by_spans = bool(spans) and getattr(tokenizer_of(processor), "is_fast", False)
    ids, media, ranges = _process(processor, text, images, videos, offsets=by_spans)
    mask = _overlaps(ranges, spans) if by_spans else assistant_mask(ids, processor)
    if media:
        start, end = special_ids(processor, (MEDIA_START, MEDIA_END))
        inside = False
        for i, t in enumerate(ids):
            inside = inside or t == start
            mask[i] = mask[i] and not inside
            inside = inside and t != end
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    return Document(ids, labels, images, videos, media, splittable=False)


def sample_messages(sample: Sample | Any, *, with_response: bool) -> list[dict[str, Any]]:
    """A world sample as a chat: a user turn (its image, its video, then `sample.question`), and with
    `with_response` the assistant turn `sample.response`."""
    parts: list[dict[str, Any]] = []
    if sample.image is not None:
        parts.append({"type": "image", "image": sample.image})
    if sample.video is not None:
        parts.append({"type": "video", "video": sample.video})
    parts.append({"type": "text", "text": sample.question})
    messages = [{"role": "user", "content": parts}]
    if with_response:
        messages.append({"role": "assistant", "content": sample.response})
    return messages


def encode_sample(sample: Sample, processor: Any, *, chat: bool) -> Document:
    """A world sample as a training document (see the module docstring for both forms).

    chat=True: a user turn (the media, then `sample.question`) and an assistant turn (`sample.response`), loss on
    the assistant turn only. chat=False: the pre-training form `[BOS] media Question: ...\\nAnswer: ... [EOS]` with
    loss on the text after the media.
    """
    if chat:
        return encode_chat(sample_messages(sample, with_response=True), processor)
    segments: list[str | Media] = [Media("image", sample.image)] if sample.image is not None else []
    if sample.video is not None:
        segments.append(Media("video", sample.video))
    segments.append(sample_text(sample))
    return encode_document(segments, processor)


# ------------------------------------------------------------------------------------------------------------ prompts
@dataclass
class Prompt:
    """An RL prompt with what verifies its replies (the attributes `kimi_vl.training.rewards.reward` reads).

    Attributes:
        messages: the chat up to and including the last user turn; media as content parts holding decoded media.
        answer: the ground truth the reward compares with (an option letter for multiple choice).
        reward: the reward kind (`kimi_vl.training.rewards.REWARD_KINDS`).
        task: what kind of prompt it is, for per-task metrics (a world task, or a user row's `data_source`).
        choices: option texts of a multiple-choice prompt, else None.
        meta: reward details, e.g. {"precision": 1} for numbers, {"boxes": ...} for grounding.
        source: name of the data source it was drawn from ("" for prompts not drawn from a named source).
    """

    messages: list[dict[str, Any]]
    answer: str
    reward: str
    task: str = "prompt"
    choices: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def as_prompt(item: Any) -> Prompt:
    """`item` as a `Prompt`: a `Prompt` (or anything with `messages`) as it is; a world `Sample` (or an object with
    its attributes: `question`, `image`, `video`, `answer`, `reward`, ...) as one user turn (its image, its video,
    then its question)."""
    if hasattr(item, "messages"):
        return item
    return Prompt(sample_messages(item, with_response=False), item.answer, item.reward,
                  task=getattr(item, "task", "prompt"), choices=getattr(item, "choices", None),
                  meta=getattr(item, "meta", None) or {})


def encode_prompt(prompt: Any, processor: Any, processor_kwargs: dict | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`(ids [L], media)` of an RL prompt (`as_prompt(prompt)`): its messages (a chat ending with a user turn;
    media in its parts) rendered with the generation prompt (the assistant header). Media need a
    `KimiVLProcessor`; text-only prompts work with a bare tokenizer as well."""
    messages = _check_messages(as_prompt(prompt).messages)
    images, videos = message_media(messages)
    text = render_chat(messages, add_generation_prompt=True, chat_template=_chat_template(processor))
    ids, media = process(processor, text, images, videos, **(processor_kwargs or {}))
    return torch.tensor(ids, dtype=torch.long), media


def left_pad(rows: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]], pad_token_id: int,
             device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A `generate` batch from `(ids [L_i], media)` rows: `input_ids` / `attention_mask` `[n, max L_i]` with the
    prompts right-aligned (left padding), and each media key concatenated over the rows in order."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, _) in enumerate(rows):
        ids[i, width - len(p):] = p
        attn[i, width - len(p):] = 1
    batch = {"input_ids": ids.to(device), "attention_mask": attn.to(device)}
    for key in MEDIA_KEYS:
        parts = [m[key] for _, m in rows if key in m]
        if parts:
            batch[key] = torch.cat(parts, dim=0).to(device)
    return batch


__all__ = [
    "IGNORE_INDEX", "MEDIA_KEYS", "Document", "Media", "Prompt", "as_prompt", "assistant_mask", "encode_chat",
    "encode_document", "encode_prompt", "encode_sample", "encode_text", "end_token_ids", "is_video_file", "left_pad",
    "message_media", "plain_ids", "process", "sample_messages", "special_ids", "tokenizer_of", "video_inputs",
]
