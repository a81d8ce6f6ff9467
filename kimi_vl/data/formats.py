"""Users' record schemas -> canonical records: pre-training documents, chats and RL prompts.

A format is detected from a record's keys (first match below) unless one is given (`--format`):

- `messages` (chat): `messages` (`role`, `content`: a string or typed parts), `images`?, `videos`? (HF, OpenAI,
  LLaMA-Factory);
- `sharegpt` (chat): `conversations` (`from`, `value`), `image`? / `images`?, `video`? / `videos`?, `system`?
  (LLaVA, ShareGPT; a record with videos and no image whose turns have one `<image>` per video and no `<video>`, as
  LLaVA-NeXT's video data (LLaVA-Video-178K, LLaVA-OneVision) marks them, reads those `<image>` as `<video>`);
- `verl` (prompt): `prompt` (a chat), `reward_model.ground_truth`, `data_source`, `images`?, `extra_info`?;
- `easyr1` (prompt): `problem`, `answer`, `images`?;
- `trl` (prompt): TRL's GRPO datasets: `prompt` (a string or a chat), `solution` (or `answer`; a worked solution is
  read from its last `\\boxed{}`), `image` / `images`?;
- `obelics` (document): `texts`, `images` (equal lengths, None where the other modality sits);
- `text` (document): `text`, `images`?, `videos`? (FineWeb-style corpora, captions with placeholders);
- `webdataset` (document): a tar shard's `key.jpg|png|webp` + `key.txt|json` (caption under `caption`/`text`);
- `plain` (document): a `.txt` file, the whole file as text (no placeholders).

`llava` is another name for `sharegpt`. Placeholders: `<image>` and `<video>` in text stand for the record's
`images` / `videos` in order; their count must equal the list's length, and a record with media but no placeholder
at all gets them prepended (to the document, or to the first user turn). Typed content parts (`{"type": "image"}`
without data) take the record's list items in order, as HF datasets store them.

Media values: a path (relative to the data file's folder, or to `media_root` when given), a `file://` URL, for an
image an inline `data:image/...;base64,...` URI (OpenAI's `image_url` parts), the HF Image feature's
`{"bytes", "path"}` struct, raw bytes, a decoded PIL image, or for a video a list of frame images.

Every problem with a record (missing key, unknown role, placeholder/media count mismatch, no assistant turn, no RL
answer or a list of several, an RL answer its reward cannot score (`kimi_vl.training.rewards.true_number` /
`true_boxes`: the parse the reward runs), an empty RL problem, a reserved special-token string inside a chat, a
missing or corrupt media file) raises `BadRecordError` with a reason; the data layer logs and skips it (see
`kimi_vl.data.mixture`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadRecordError, ConfigError, InvalidMediaError
from ..tokenization.special_tokens import SPECIAL_TOKENS
from ..vision.media import is_data_uri, load_image, short_source
from .encode import Media, Prompt

KINDS: tuple[str, ...] = ("document", "chat", "prompt")
PLACEHOLDER = re.compile(r"(<image>|<video>)")
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "bot": "assistant", "model": "assistant", "function_call": "assistant", "tool": "tool",
         "observation": "tool", "function": "tool"}
"""Role names of the supported schemas -> the chat template's roles."""
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
REWARD_CHOICES: tuple[str, ...] = ("choice", "number", "exact", "ocr", "grounding", "html")
"""`--reward` values: the verifiable rewards an RL prompt row can be scored with."""


# ----------------------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class MediaRef:
    """An image or a video of a record, not read yet: `kind` ("image" | "video"), `value` (see the module
    docstring), `base` (the folder relative paths are read from)."""

    kind: str
    value: Any
    base: Path | None = None

    def resolve_path(self, value: str) -> str:
        if "://" in value or is_data_uri(value) or self.base is None or os.path.isabs(value):
            return value
        return str(self.base / value)

    def load(self) -> Any:
        """The decoded media: an RGB PIL image; a video file's path (read by the video processor) or a
        `[T, H, W, 3]` uint8 array of its frame images. `InvalidMediaError` when it cannot be read."""
        value = self.value
        if isinstance(value, dict):  # the HF Image feature's struct
            value = value.get("bytes") or value.get("path")
            if value is None:
                raise InvalidMediaError(f"a {self.kind} struct has neither 'bytes' nor 'path'.")
        if self.kind == "image":
            if isinstance(value, (bytes, bytearray)):
                return load_image(bytes(value))
            if isinstance(value, str):
                return load_image(self.resolve_path(value))
            return load_image(value)
        if isinstance(value, str):
            if is_data_uri(value):
                raise InvalidMediaError(f"video {short_source(value)!r}: inline data: URIs are read for images only; "
                                        "save the video to a file (or give its frames as a list of images).")
            path = self.resolve_path(value)
            if os.path.isdir(path.removeprefix("file://")):
                raise InvalidMediaError(f"video {short_source(path)!r} is a folder; give a video file, or the folder's "
                                        "frame images as a list of paths in order.")
            if not os.path.isfile(path.removeprefix("file://")):
                raise InvalidMediaError(f"video file {short_source(path)!r} does not exist; check the path (or "
                                        "--media-root).")
            return path
        if isinstance(value, (list, tuple)) and value:
            frames = [np.asarray(MediaRef("image", v, self.base).load()) for v in value]
            if len({f.shape for f in frames}) > 1:
                raise InvalidMediaError(f"the {len(frames)} frame images of a video have different sizes "
                                        f"{sorted({f.shape[:2] for f in frames})}; give frames of one size.")
            return np.stack(frames)
        raise InvalidMediaError(f"a video must be a file path or a non-empty list of frame images, got "
                                f"{type(value).__name__}.")


@dataclass
class Record:
    """A parsed record, media not read yet.

    Attributes:
        kind: "document", "chat" or "prompt".
        segments: (document) text pieces and `MediaRef`s in order.
        messages: (chat, prompt) `{"role", "content": [parts]}` with parts `{"type": "text", "text"}`,
            `{"type": "image", "image": MediaRef}`, `{"type": "video", "video": MediaRef}`.
        answer, reward, task, choices, meta: (prompt) what verifies a reply (see `kimi_vl.data.encode.Prompt`).
        format: the name of the schema it was read with.
    """

    kind: str
    segments: list[str | MediaRef] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: str = ""
    reward: str = ""
    task: str = ""
    choices: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    format: str = ""

    def media(self) -> list[MediaRef]:
        """The record's media in order."""
        if self.kind == "document":
            return [s for s in self.segments if isinstance(s, MediaRef)]
        return [p[p["type"]] for m in self.messages for p in m["content"] if p["type"] in ("image", "video")]

    def text(self) -> str:
        """All of the record's text (for tokenizer training and token estimates)."""
        if self.kind == "document":
            return "".join(s for s in self.segments if isinstance(s, str))
        return "\n".join(p["text"] for m in self.messages for p in m["content"] if p["type"] == "text")

    def loaded(self) -> Any:
        """The record with its media read: a list of document segments (text and `Media`), a chat's messages, or
        a `Prompt`. `InvalidMediaError` when a media file cannot be read."""
        if self.kind == "document":
            return [Media(s.kind, s.load()) if isinstance(s, MediaRef) else s for s in self.segments]
        messages = [{"role": m["role"], "content": [
            {"type": p["type"], p["type"]: p[p["type"]].load()} if p["type"] in ("image", "video") else p
            for p in m["content"]]} for m in self.messages]
        if self.kind == "chat":
            return messages
        return Prompt(messages, self.answer, self.reward, task=self.task, choices=self.choices, meta=self.meta)


# ----------------------------------------------------------------------------------------------------------- helpers
def _bad(reason: str) -> BadRecordError:
    return BadRecordError(reason)


def _short(value: Any, limit: int = 80) -> str:
    """`value` (a string, else its repr) cut to about `limit` characters for a message (`short_source`)."""
    return short_source(value if isinstance(value, str) else repr(value), limit)


def _require(row: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in row or row[key] is None:
        raise _bad(f"no '{key}' ({what})")
    value = row[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _bad(f"'{key}' is a {type(value).__name__}, not a {names}")
    return value


def _media_list(row: dict, key: str, kind: str, base: Path | None) -> list[MediaRef]:
    value = row.get(key)
    if value is None:
        return []
    if isinstance(value, (str, dict, bytes)) or (kind == "image" and hasattr(value, "mode")):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _bad(f"'{key}' is a {type(value).__name__}, not a list of {kind}s")
    if any(isinstance(v, str) and not v.strip() for v in value):
        raise _bad(f"'{key}' holds an empty path; give each {kind}'s file (or leave the key out)")
    return [MediaRef(kind, v, base) for v in value]


def _split_placeholders(text: str, images: list[MediaRef], videos: list[MediaRef], where: str
                        ) -> list[str | MediaRef]:
    """`text` with its `<image>` / `<video>` placeholders replaced by the media in order (counts checked)."""
    pieces = PLACEHOLDER.split(text)
    n_img, n_vid = pieces.count("<image>"), pieces.count("<video>")
    if n_img != len(images) or n_vid != len(videos):
        raise _bad(f"{where} has {n_img} <image> and {n_vid} <video> placeholders but the record has "
                   f"{len(images)} images and {len(videos)} videos")
    imgs, vids = iter(images), iter(videos)
    return [next(imgs) if p == "<image>" else next(vids) if p == "<video>" else p for p in pieces if p]


def _check_text(text: str, where: str) -> str:
    if not isinstance(text, str):
        raise _bad(f"{where} is a {type(text).__name__}, not a string")
    for token in SPECIAL_TOKENS:
        if token in text:
            raise _bad(f"{where} contains the reserved token {token!r} (it would be read as a control token); "
                       "remove it from the data")
    return text


def _parts(content: Any, images: list[MediaRef], videos: list[MediaRef], taken: dict[str, int], base: Path | None,
           where: str) -> list[dict[str, Any]]:
    """A message's content as typed parts; placeholders and data-less typed parts take the record's media."""
    if isinstance(content, str):
        pieces = PLACEHOLDER.split(content)
        parts = []
        for p in pieces:
            if p in ("<image>", "<video>"):
                kind = p[1:-1]
                pool = images if kind == "image" else videos
                if taken[kind] >= len(pool):
                    raise _bad(f"{where} has more <{kind}> placeholders than the record's {len(pool)} {kind}s")
                parts.append({"type": kind, kind: pool[taken[kind]]})
                taken[kind] += 1
            elif p:
                parts.append({"type": "text", "text": _check_text(p, where)})
        return parts
    if not isinstance(content, (list, tuple)):
        raise _bad(f"{where} content is a {type(content).__name__}, not a string or a list of parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or "type" not in part:
            raise _bad(f"{where} has a content part that is not a {{'type': ...}} dict")
        kind = part["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _check_text(part.get("text"), where)})
        elif kind in ("image", "image_url", "video"):
            kind = "video" if kind == "video" else "image"
            data = part.get(kind, part.get("path", part.get("url", part.get("image_url"))))
            if isinstance(data, dict) and "url" in data and "bytes" not in data:  # OpenAI {"image_url": {"url"}}
                data = data["url"]
            if data is None:
                pool = images if kind == "image" else videos
                if taken[kind] >= len(pool):
                    raise _bad(f"{where} has more {kind} parts than the record's {len(pool)} {kind}s")
                ref = pool[taken[kind]]
                taken[kind] += 1
            else:
                ref = MediaRef(kind, data, base)
            parts.append({"type": kind, kind: ref})
        else:
            raise _bad(f"{where} has a content part of unknown type {kind!r} (text, image, video)")
    return parts


def _chat(turns: list[tuple[str, Any, str]], images: list[MediaRef], videos: list[MediaRef], base: Path | None,
          *, need_assistant: bool) -> list[dict[str, Any]]:
    """Messages from `(role, content, where)` turns (`where`: the turn as the record holds it, e.g.
    `conversations[2]`, for error messages); the record's media go to their placeholders, or before the first user
    turn's content when no turn has any."""
    taken = {"image": 0, "video": 0}
    messages = []
    for role, content, where in turns:
        if role not in ROLES:
            raise _bad(f"{where} has the unknown role {role!r} (known: {', '.join(sorted(ROLES))})")
        messages.append({"role": ROLES[role], "content": _parts(content, images, videos, taken, base, where)})
    if taken["image"] == 0 and taken["video"] == 0 and (images or videos):
        user = next((m for m in messages if m["role"] == "user"), None)
        if user is None:
            raise _bad("the record has media but no user turn to put them in")
        user["content"] = ([{"type": "image", "image": r} for r in images]
                           + [{"type": "video", "video": r} for r in videos] + user["content"])
    elif taken["image"] != len(images) or taken["video"] != len(videos):
        raise _bad(f"the turns have {taken['image']} image and {taken['video']} video placeholders but the record "
                   f"has {len(images)} images and {len(videos)} videos")
    if need_assistant and not any(m["role"] == "assistant" and any(
            p["type"] != "text" or p["text"].strip() for p in m["content"]) for m in messages):
        raise _bad("no assistant turn (nothing to train on)")
    return messages


# ----------------------------------------------------------------------------------------------------------- parsers
def _messages(row: dict, base: Path | None) -> Record:
    turns = _require(row, "messages", list, "the conversation")
    for i, m in enumerate(turns):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _bad(f"messages[{i}] is not a {{'role', 'content'}} dict")
    images, videos = _media_list(row, "images", "image", base), _media_list(row, "videos", "video", base)
    return Record("chat", messages=_chat([(m["role"], m["content"], f"messages[{i}]") for i, m in enumerate(turns)],
                                         images, videos, base, need_assistant=True))


def _sharegpt(row: dict, base: Path | None) -> Record:
    turns = _require(row, "conversations", list, "the conversation")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise _bad(f"conversations[{i}] is not a {{'from', 'value'}} dict")
    images = _media_list(row, "images" if row.get("images") is not None else "image", "image", base)
    videos = _media_list(row, "videos" if row.get("videos") is not None else "video", "video", base)
    values = [t["value"] for t in turns]
    texts = "".join(v for v in values if isinstance(v, str))
    if videos and not images and "<video>" not in texts and texts.count("<image>") == len(videos):
        # LLaVA-NeXT's video records (LLaVA-Video-178K, LLaVA-OneVision) mark their videos with <image>
        values = [v.replace("<image>", "<video>") if isinstance(v, str) else v for v in values]
    pairs = [(t["from"], v, f"conversations[{i}]") for i, (t, v) in enumerate(zip(turns, values))]
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise _bad(f"'system' is a {type(system).__name__}, not a string (the system prompt)")
    if system:
        pairs.insert(0, ("system", system, "'system'"))
    return Record("chat", messages=_chat(pairs, images, videos, base, need_assistant=True))


def _answer(value: Any) -> str:
    """A row's RL ground truth as the text the rewards read: a string or a number, a list of exactly one, or a
    grounding answer's boxes as JSON lists (`[[x0, y0, x1, y1], ...]`, written back as that text)."""
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(box, (list, tuple)) and len(box) == 4 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in box) for box in value):
        return json.dumps([list(box) for box in value])
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise _bad(f"the RL answer is a list of {len(value)} values ({_short(value)}); give one ground truth "
                       "(a string or a number, or a list of exactly one; grounding boxes as [[x0, y0, x1, y1], ...])")
        value = value[0]
    if isinstance(value, (dict, list, tuple)):
        raise _bad(f"the RL answer is a {type(value).__name__} ({_short(value)}), not a string or a number")
    if value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, float) and value != value):
        raise _bad("no RL answer (the ground truth is missing, empty or NaN: a Parquet float column's missing value)")
    return str(value).strip()


def _prompt_messages(row: dict, base: Path | None, *, text_allowed: bool = False) -> list[dict[str, Any]]:
    """The messages of an RL row's `prompt`: a chat (a list of `{'role', 'content'}` dicts ending with a user turn),
    or with `text_allowed` a string (one user turn), with the row's `images` / `videos` at their placeholders."""
    prompt = row.get("prompt")
    if text_allowed and isinstance(prompt, str):
        if not prompt.strip():
            raise _bad("'prompt' is empty; give the question (text, <image> placeholders)")
        turns = [("user", prompt, "'prompt'")]
    else:
        chat = _require(row, "prompt", list, "the prompt chat")
        for i, m in enumerate(chat):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise _bad(f"prompt[{i}] is not a {{'role', 'content'}} dict")
        turns = [(m["role"], m["content"], f"prompt[{i}]") for i, m in enumerate(chat)]
    images = _media_list(row, "images" if row.get("images") is not None else "image", "image", base)
    videos = _media_list(row, "videos", "video", base)
    messages = _chat(turns, images, videos, base, need_assistant=False)
    if not messages or messages[-1]["role"] != "user":
        raise _bad("the prompt does not end with a user turn")
    return messages


def _verl(row: dict, base: Path | None) -> Record:
    truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    answer = _answer(truth)
    messages = _prompt_messages(row, base)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return Record("prompt", messages=messages, answer=answer, task=str(row.get("data_source") or "verl"),
                  meta={"extra_info": extra})


def _trl(row: dict, base: Path | None) -> Record:
    answer = _answer(row["solution"] if "solution" in row else row.get("answer"))
    messages = _prompt_messages(row, base, text_allowed=True)
    return Record("prompt", messages=messages, answer=answer, task=str(row.get("data_source") or "trl"))


def _easyr1(row: dict, base: Path | None) -> Record:
    problem = _require(row, "problem", str, "the question")
    if not problem.strip():
        raise _bad("'problem' is empty; give the question (text, <image> placeholders)")
    answer = _answer(row.get("answer"))
    images, videos = _media_list(row, "images", "image", base), _media_list(row, "videos", "video", base)
    messages = _chat([("user", problem, "'problem'")], images, videos, base, need_assistant=False)
    return Record("prompt", messages=messages, answer=answer, task=str(row.get("data_source") or "easyr1"))


def _text(row: dict, base: Path | None) -> Record:
    text = _require(row, "text", str, "the document text")
    images, videos = _media_list(row, "images", "image", base), _media_list(row, "videos", "video", base)
    if (images or videos) and not PLACEHOLDER.search(text):
        return Record("document", segments=[*images, *videos, text])
    return Record("document", segments=_split_placeholders(text, images, videos, "the text"))


def _plain(row: dict, base: Path | None) -> Record:
    return Record("document", segments=[_require(row, "text", str, "the document text")])


def _obelics(row: dict, base: Path | None) -> Record:
    texts, images = _require(row, "texts", list, "the text slots"), _require(row, "images", list, "the image slots")
    if len(texts) != len(images):
        raise _bad(f"'texts' has {len(texts)} slots but 'images' has {len(images)}; they must be equal")
    segments: list[str | MediaRef] = []
    for i, (t, im) in enumerate(zip(texts, images)):
        if (t is None) == (im is None):
            raise _bad(f"slot {i} has {'both a text and an image' if t is not None else 'neither text nor image'}")
        if t is not None:
            if segments and isinstance(segments[-1], str):
                segments[-1] += "\n\n" + str(t)
            else:
                segments.append(str(t))
        else:
            segments.append(MediaRef("image", im, base))
    return Record("document", segments=segments)


def _webdataset(row: dict, base: Path | None) -> Record:
    image = next((row[e] for e in IMAGE_EXTENSIONS if e in row), None)
    if image is None:
        raise _bad(f"sample {row.get('__key__')!r} has no image ({'/'.join(IMAGE_EXTENSIONS)}); found "
                   f"{sorted(k for k in row if k != '__key__')}")
    if "txt" in row:
        caption = row["txt"].decode("utf-8", "replace") if isinstance(row["txt"], bytes) else str(row["txt"])
    elif "json" in row:
        try:
            meta = json.loads(row["json"])
        except (ValueError, TypeError) as exc:
            raise _bad(f"sample {row.get('__key__')!r} has malformed JSON ({exc})") from exc
        caption = meta.get("caption", meta.get("text")) if isinstance(meta, dict) else None
        if not isinstance(caption, str):
            raise _bad(f"sample {row.get('__key__')!r}: its .json has no 'caption' or 'text' string")
    else:
        raise _bad(f"sample {row.get('__key__')!r} has no caption (.txt or .json)")
    return Record("document", segments=[MediaRef("image", image, base), caption.strip()])


@dataclass(frozen=True)
class Format:
    """A record schema: its kind, whether a record's keys show it, and its parser `(row, base) -> Record`."""

    name: str
    kind: str
    detect: Callable[[dict], bool]
    parse: Callable[[dict, Path | None], Record]


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("messages", "chat", lambda r: "messages" in r, _messages),
    Format("sharegpt", "chat", lambda r: "conversations" in r, _sharegpt),
    Format("verl", "prompt", lambda r: "prompt" in r and "reward_model" in r, _verl),
    Format("easyr1", "prompt", lambda r: "problem" in r and "answer" in r, _easyr1),
    Format("trl", "prompt", lambda r: "prompt" in r and ("solution" in r or "answer" in r), _trl),
    Format("obelics", "document", lambda r: "texts" in r and "images" in r, _obelics),
    Format("text", "document", lambda r: "text" in r, _text),
    Format("webdataset", "document", lambda r: "__key__" in r, _webdataset),
    Format("plain", "document", lambda r: False, _plain),
)}
ALIASES = {"llava": "sharegpt"}


def get_format(name: str) -> Format:
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        raise ConfigError(f"unknown data format {name!r}; choose one of {', '.join([*FORMATS, *ALIASES])} "
                          "(or 'auto' to detect it from each file's first record).")
    return FORMATS[name]


def detect_format(row: Any) -> Format:
    """The format a record's keys show (`BadRecordError` when none does). Keys holding None count only when no
    format fits the others: a Parquet file (or JSON with nulls) mixing schemas holds every column in every row."""
    if not isinstance(row, dict):
        raise _bad(f"a record is a {type(row).__name__}, not a JSON object")
    present = {k: v for k, v in row.items() if v is not None}
    for keys in (present, row):
        for f in FORMATS.values():
            if f.detect(keys):
                return f
    raise _bad(f"no known schema has the keys {sorted(row)[:12]}; pass --format (one of {', '.join(FORMATS)})")


# ------------------------------------------------------------------------------------------------------------ rewards
_BOXES = re.compile(r"^\s*\[\s*\[.*\]\s*\]\s*$", re.S)
_NUMBER = re.compile(r"^\s*[-+]?((\d{1,3}(,\d{3})+|\d+)(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")
"""One number, commas only as thousands separators (`1,234`; `3,5` or `2,3` is no number: a decimal comma or a
list)."""


def default_reward(record: Record) -> str:
    """The reward kind a prompt row gets without `--reward`, from its answer's form and `data_source`: a single
    option letter -> "choice", `[[x0, y0, x1, y1], ...]` -> "grounding", a number -> "number", an HTML page ->
    "html", an OCR data source (`ocr` at a word's start or end: OCRBench, ocr_vqa, TextOCR) -> "ocr", anything else ->
    "exact" (normalised exact match)."""
    answer = record.answer.strip()
    if re.fullmatch(r"\(?[A-Z]\)?", answer):
        return "choice"
    if _BOXES.match(answer):
        return "grounding"
    if _NUMBER.match(answer):
        return "number"
    if answer.startswith("<") and "</" in answer:
        return "html"
    if re.search(r"(?<![a-z])ocr|ocr(?![a-z])", record.task.lower()):  # OCRBench, ocr_vqa, TextOCR; not Socratic
        return "ocr"
    return "exact"


def with_reward(record: Record, reward: str | None) -> Record:
    """A prompt record with its reward kind (`reward`, else `default_reward`); grounding boxes go to `meta`. An
    answer holding a `\\boxed{...}` (a worked solution, as MATH gives it) is the content of its last box, as a reply's
    answer is read (an empty box is no answer)."""
    if reward is not None and reward not in REWARD_CHOICES:
        raise ConfigError(f"unknown reward {reward!r}; choose one of {', '.join(REWARD_CHOICES)}.")
    # not at the top: kimi_vl.training imports kimi_vl.data
    from ..training.rewards import last_boxed, true_boxes, true_number

    if (boxed := last_boxed(record.answer)) is not None:
        if not boxed:
            raise _bad(f"the answer {_short(record.answer)!r} boxes nothing; put the ground truth in the box")
        record = replace(record, answer=boxed)
    kind = reward or default_reward(record)
    answer = record.answer
    fix = "fix the answer, or " + ("pick another --reward" if reward else "pass --reward exact to compare it as text")
    if kind == "choice":
        answer = answer.strip().strip("()")
        if not re.fullmatch(r"[A-Za-z]", answer):
            raise _bad(f"the answer {_short(record.answer)!r} is not an option letter (reward choice)")
    elif kind in ("number", "count"):
        try:  # the parse the reward itself runs, so that a row that passes here can be scored
            true_number(answer)
        except ConfigError as exc:
            raise _bad(f"reward {kind} cannot score this row: {str(exc).rstrip('.')}; {fix}") from exc
    elif kind == "grounding":
        if not _BOXES.match(answer):
            raise _bad(f"the answer {_short(answer)!r} is not a list of [x0, y0, x1, y1] boxes (reward grounding)")
        try:
            true_boxes(answer)
        except ConfigError as exc:
            raise _bad(f"reward grounding cannot score this row: {exc}") from exc
    return replace(record, reward=kind, answer=answer)


def parse_record(row: Any, fmt: Format | None, base: Path | None, *, reward: str | None = None) -> Record:
    """A row as a `Record` (`fmt` None: detected from the row's keys); prompts get their reward kind."""
    fmt = fmt or detect_format(row)
    if not isinstance(row, dict):
        raise _bad(f"a record is a {type(row).__name__}, not a JSON object")
    record = replace(fmt.parse(row, base), format=fmt.name)
    return with_reward(record, reward) if record.kind == "prompt" else record


def error_reason(exc: BaseException) -> str:
    """What a bad-record log says of an exception raised while reading, parsing or encoding a record."""
    if isinstance(exc, BadRecordError):
        return exc.reason
    if isinstance(exc, InvalidMediaError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


__all__ = ["ALIASES", "FORMATS", "KINDS", "REWARD_CHOICES", "Format", "MediaRef", "Record", "default_reward",
           "detect_format", "error_reason", "get_format", "parse_record", "with_reward"]
