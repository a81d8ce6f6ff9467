"""Training documents and their packing into fixed-size rows for `KimiVLForConditionalGeneration` with `cu_seqlens`.

Documents (`Document`): token ids + labels (-100 where there is no loss) + the processed media they hold.
- `encode_text`: `[BOS] text [EOS]`, loss on every token after `[BOS]`; special-token strings inside the text stay
  plain text (they are never turned into control tokens). Splittable: it may be cut anywhere.
- `encode_sample(sample, processor, chat=False)`, the pre-training form of a world sample: `[BOS]`, then the
  media (one image block `<|media_start|>image<|media_content|><|media_pad|>x N<|media_end|>`, or for a video one
  `HH:MM:SS.mmm<|media_start|>video<|media_content|>...<|media_end|>` block per temporal chunk), then the text
  `Question: ...\\nAnswer: ...` (`world.sample_text`), then `[EOS]`. No loss on `[BOS]` nor on anything up to the
  last `<|media_end|>` (placeholders, media markers, the word `image`/`video`, chunk timestamps); loss on the text.
- `encode_sample(sample, processor, chat=True)` / `encode_chat(messages, processor)`: Kimi's chat format (the
  processor's chat template); loss only on assistant turns: their content and their closing `<|im_end|>`, not
  on the `<|im_assistant|>assistant<|im_middle|>` header nor on system / user / tool turns.
Media documents carry the processor's tensors (`pixel_values` `[patches, 3, 14, 14]`, `image_grid_thw` `[images,
3]`, `pixel_values_videos`, `video_grid_thw` `[chunks, 3]`) in `Document.media`.

Packing (`PackedStream.batch(i)`): `rows` rows of exactly `seq_len` tokens laid end to end in one `[1, rows *
seq_len]` sequence. Every document (or piece of one) is its own `cu_seqlens` segment, and every row boundary is a
segment boundary. Placement, row by row:
- a splittable document (plain text) fills the rest of the current row and continues in the next row;
- any other document is placed whole. One that does not fit in the rest of the row waits for the next row (it is
  the first candidate there), and up to `max_misses` further drawn documents are tried in the gap; when none fits,
  the rest of the row becomes padding (`[PAD]` ids, labels -100, its own segment). Waiting documents are placed
  oldest first;
- a document longer than a row is cut into `seq_len` pieces starting at a row beginning (a cut may not fall inside
  a run of media placeholders: `ConfigError`);
- a batch starts afresh: what is left of a document at the end of a batch is not carried over.
The pixel tensors concatenate the media of all rows in order (images and videos separately), so
`model(**batch.model_inputs())` scatters them onto their placeholders.

Vision ratio (`vision_ratio`): the vision tokens of a batch are its image and video placeholder tokens (one per
merged vision token). Row by row, vision documents go first, each one placed when it brings the batch's vision
tokens closer to `vision_ratio` x (the tokens of the rows so far plus half a row, capped at the batch); then text
documents fill the rest of the row. Every batch, the first included, thus holds about `vision_ratio` of its tokens
as vision tokens: within about one vision document (the tests check +-0.07 at 4 x 256 tokens with screencasts,
+-0.04 with images only). Vision documents also hold text (questions, answers, HTML), so a ratio above their own
density (about 0.3 for the world's images with a 256-patch budget) cannot be reached: batches then get as many
vision tokens as whole vision documents allow.

Determinism: `batch(i)` draws everything from `random.Random(f"packed:{seed}:{i}")`, so it is a pure function of
`(seed, i)` (resuming at any step reproduces the same data) and batches can be built in any order.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, InvalidMediaError, ShapeError
from ...fusion.chat_template import CHAT_TEMPLATE, IMAGE_PROMPT, VIDEO_PROMPT, render_chat
from ...fusion.tokenizer import (
    BOS,
    DOC_EOS,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    MEDIA_END,
    MEDIA_PAD,
    PAD,
    SPECIAL_TOKENS,
    VIDEO_PLACEHOLDER,
)
from .corpus import stdlib_window
from .screencast import Screencast
from .world import (
    LETTERS,
    TEXT_TASKS,
    VIDEO_TASKS,
    VISION_TASKS,
    Sample,
    make_sample,
    option_lookup,
    options_block,
    sample_text,
)

IGNORE_INDEX = -100
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


@dataclass
class Document:
    """One training document before packing.

    Attributes:
        input_ids: token ids, length T.
        labels: length T; the token id where the token is a target of the loss, -100 elsewhere.
        images: source images (PIL), in placeholder order (kept for reference; packing uses `media`).
        videos: source videos (`Screencast` or frame arrays), in placeholder order.
        media: the processor's tensors for those media: `pixel_values`, `image_grid_thw`, `pixel_values_videos`,
            `video_grid_thw` (only the keys present).
        splittable: the document may be cut at any token (plain text); otherwise it is placed whole when it fits
            in a row.
    """

    input_ids: list[int]
    labels: list[int]
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    splittable: bool = False

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ShapeError(f"a Document has {len(self.input_ids)} input_ids but {len(self.labels)} labels; give "
                             "one label per token (-100 where there is no loss).")

    def __len__(self) -> int:
        return len(self.input_ids)


# ----------------------------------------------------------------------------------------------------------- encoding
def _tokenizer(processor_or_tokenizer: Any) -> Any:
    return getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)


def _ids(tokenizer: Any, tokens: Sequence[str]) -> list[int]:
    """Ids of special `tokens` (`ConfigError` when the tokenizer lacks one)."""
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = [t for t, i in zip(tokens, ids) if i is None or (unk is not None and i == unk)]
    if missing:
        raise ConfigError(f"the tokenizer lacks the special tokens {missing}; build it with "
                          "kimi_vl.fusion.build_tokenizer.")
    return ids


def encode_text(text: str, tokenizer: Any) -> Document:
    """A plain language-modelling document `[BOS] text [EOS]` (labels: -100 on `[BOS]`, the ids elsewhere).

    `tokenizer` may be a tokenizer or a `KimiVLProcessor`. Special-token strings in `text` are tokenized as
    plain text. The document is splittable.
    """
    tok = _tokenizer(tokenizer)
    bos, eos = _ids(tok, (BOS, DOC_EOS))
    body = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids = [bos, *body, eos]
    return Document(ids, [IGNORE_INDEX, *ids[1:]], splittable=True)


def _video_inputs(videos: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Processor inputs for `videos`: decoded frames `[T, H, W, 3]` with `video_metadata` (exact timestamps) for
    `Screencast`s and frame sequences, paths as they are."""
    if all(isinstance(v, (str, bytes)) or hasattr(v, "__fspath__") for v in videos):
        return list(videos), {}
    arrays, metadata = [], []
    for v in videos:
        if isinstance(v, Screencast):
            frames, fps = v.frames, v.fps
        elif isinstance(v, (list, tuple, np.ndarray, torch.Tensor)):
            frames, fps = v, None
        else:
            raise InvalidMediaError(f"a video of type {type(v).__name__} cannot be used here; pass a Screencast, "
                                    "a list of frames, a [T, H, W, 3] array, or (for all videos) file paths.")
        array = np.stack([np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8)
                          for f in frames])
        arrays.append(array)
        meta = {"total_num_frames": int(array.shape[0])}
        if fps:
            meta["fps"] = float(fps)
        metadata.append(meta)
    return arrays, {"video_metadata": metadata, "do_sample_frames": False}


def _process(processor: Any, text: str, images: list, videos: list) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of `text` (placeholders expanded) and the media tensors."""
    if not images and not videos:
        return _tokenizer(processor)(text, add_special_tokens=False)["input_ids"], {}
    kwargs: dict[str, Any] = {}
    video_inputs = None
    if videos:
        video_inputs, kwargs = _video_inputs(videos)
    out = processor(text=text, images=list(images) or None, videos=video_inputs, **kwargs)
    ids = out["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    media = {k: torch.as_tensor(out[k]) for k in MEDIA_KEYS if out.get(k) is not None}
    return list(ids[0]), media


def encode_sample(sample: Sample, processor: Any, *, chat: bool) -> Document:
    """A world sample as a training document (see the module docstring for both forms).

    chat=True: a user turn (the media, then `sample.question`) and an assistant turn (`sample.response`), loss on
    the assistant turn only. chat=False: the pre-training form `[BOS] media Question: ...\\nAnswer: ... [EOS]` with
    loss on the text after the media.
    """
    images = [sample.image] if sample.image is not None else []
    videos = [sample.video] if sample.video is not None else []
    if chat:
        parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in images]
        parts += [{"type": "video", "video": v} for v in videos]
        parts.append({"type": "text", "text": sample.question})
        return encode_chat([{"role": "user", "content": parts},
                            {"role": "assistant", "content": sample.response}], processor)
    tok = _tokenizer(processor)
    media_end = _ids(tok, (MEDIA_END,))[0]
    text = BOS + IMAGE_PROMPT * len(images) + VIDEO_PROMPT * len(videos) + sample_text(sample) + DOC_EOS
    ids, media = _process(processor, text, images, videos)
    last_media = max((i for i, t in enumerate(ids) if t == media_end), default=0)
    labels = [IGNORE_INDEX] * (last_media + 1) + ids[last_media + 1:]
    return Document(ids, labels, images, videos, media, splittable=not images and not videos)


def _message_media(messages: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    images, videos = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in ("image", "image_url"):
                source = next((part[k] for k in ("image", "path", "url", "image_url") if part.get(k) is not None),
                              None)
                if source is None:
                    raise InvalidMediaError("an image part has no image; give it under 'image' (PIL image or "
                                            "array), 'path' or 'url'.")
                images.append(source)
            elif kind == "video":
                source = next((part[k] for k in ("video", "path", "url") if part.get(k) is not None), None)
                if source is None:
                    raise InvalidMediaError("a video part has no video; give it under 'video' (Screencast or "
                                            "frames) or 'path'.")
                videos.append(source)
    return images, videos


def assistant_mask(input_ids: Sequence[int], tokenizer: Any) -> list[bool]:
    """True on the tokens of assistant turns that are trained on: each turn's content after
    `<|im_assistant|>...<|im_middle|>` up to and including its `<|im_end|>`."""
    header, middle, end = _ids(_tokenizer(tokenizer), (IM_ASSISTANT, IM_MIDDLE, IM_END))
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


def encode_chat(messages: list[dict[str, Any]], processor: Any) -> Document:
    """A conversation in Kimi's chat format with loss on the assistant turns only (their content and closing
    `<|im_end|>`). Media parts (`{"type": "image", "image": PIL}`, `{"type": "video", "video": Screencast}`) are
    expanded by the processor."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ConfigError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    images, videos = _message_media(list(messages))
    template = getattr(processor, "chat_template", None) or CHAT_TEMPLATE
    text = render_chat(list(messages), chat_template=template)
    ids, media = _process(processor, text, images, videos)
    mask = assistant_mask(ids, processor)
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    return Document(ids, labels, images, videos, media, splittable=False)


# ----------------------------------------------------------------------------------------------------------- batches
@dataclass
class PackedBatch:
    """Packed rows laid end to end (batch size 1, the layout `cu_seqlens` needs).

    Attributes:
        input_ids: `[1, rows * seq_len]` token ids.
        labels: `[1, rows * seq_len]`; -100 on padding, media tokens and other no-loss tokens.
        cu_seqlens: `[D + 1]` int32 offsets of the D segments (documents, document pieces, padding); every
            multiple of `seq_len` is one of them.
        pixel_values / image_grid_thw: all images of the batch in placeholder order (`[patches, 3, 14, 14]`,
            `[images, 3]`), or None.
        pixel_values_videos / video_grid_thw: all video chunks (`[patches, 3, 14, 14]`, `[chunks, 3]`), or None.
        rows, seq_len: the layout; `input_ids.view(rows, seq_len)` gives the rows.
        pad_token_id, image_token_id, video_token_id: the ids the token counts use.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    rows: int = 1
    seq_len: int = 0
    pad_token_id: int = SPECIAL_TOKENS.index(PAD)
    image_token_id: int = SPECIAL_TOKENS.index(MEDIA_PAD)
    video_token_id: int = SPECIAL_TOKENS.index(VIDEO_PLACEHOLDER)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for `KimiVLForConditionalGeneration.forward`: input_ids, labels, cu_seqlens and the
        media tensors that are present."""
        out = {"input_ids": self.input_ids, "labels": self.labels, "cu_seqlens": self.cu_seqlens}
        for key in MEDIA_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on `device`."""
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return PackedBatch(**moved)

    @property
    def num_tokens(self) -> int:
        """All tokens of the batch, padding included (`rows * seq_len`)."""
        return int(self.input_ids.numel())

    @property
    def num_pad_tokens(self) -> int:
        return int((self.input_ids == self.pad_token_id).sum())

    @property
    def num_loss_tokens(self) -> int:
        """Tokens the loss averages over: targets with a label, the first token of every segment excluded (as in
        `causal_lm_loss` with `cu_seqlens`)."""
        target = self.labels[0, 1:].clone()
        ends = self.cu_seqlens[1:-1].long() - 1
        target[ends[ends < target.numel()]] = IGNORE_INDEX
        return int((target != IGNORE_INDEX).sum())

    @property
    def num_vision_tokens(self) -> int:
        """Image and video placeholder tokens (one per merged vision token fed to the backbone)."""
        ids = self.input_ids
        return int(((ids == self.image_token_id) | (ids == self.video_token_id)).sum())


@dataclass
class _Unit:
    """One image or one video chunk of a document: its placeholder run `[start, end)` and its tensors."""

    kind: str  # "image" | "video"
    start: int
    end: int
    pixels: torch.Tensor
    grid: torch.Tensor


def _media_units(doc: Document, image_id: int, video_id: int) -> list[_Unit]:
    """The document's images and video chunks in token order, each matched to its placeholder run."""
    runs: dict[int, list[tuple[int, int]]] = {image_id: [], video_id: []}
    ids = doc.input_ids
    i = 0
    while i < len(ids):
        t = ids[i]
        if t in runs:
            j = i
            while j < len(ids) and ids[j] == t:
                j += 1
            runs[t].append((i, j))
            i = j
        else:
            i += 1
    units: list[_Unit] = []
    for kind, token, pix_key, grid_key in (("image", image_id, "pixel_values", "image_grid_thw"),
                                           ("video", video_id, "pixel_values_videos", "video_grid_thw")):
        grids = doc.media.get(grid_key)
        n_grids = 0 if grids is None else int(grids.shape[0])
        if len(runs[token]) != n_grids:
            raise InvalidMediaError(f"a document has {len(runs[token])} {kind} placeholder run(s) but {n_grids} "
                                    f"{kind} grid row(s) in its media; encode media documents with encode_sample / "
                                    "encode_chat, which expand one run per image / video chunk.")
        offset = 0
        for (start, end), grid in zip(runs[token], grids if grids is not None else []):
            size = int(grid.prod())
            units.append(_Unit(kind, start, end, doc.media[pix_key][offset:offset + size], grid))
            offset += size
    units.sort(key=lambda u: u.start)
    return units


class _Cursor:
    """A document being placed: how much of it has been placed, its media units and its vision tokens."""

    def __init__(self, doc: Document, image_id: int, video_id: int):
        if len(doc) == 0:
            raise ConfigError("a document source returned an empty document; every document needs tokens.")
        self.doc = doc
        self.offset = 0
        self.units = _media_units(doc, image_id, video_id) if doc.media else []
        if doc.splittable and self.units:
            raise ConfigError("a document with media cannot be splittable; set splittable=False.")

    @property
    def remaining(self) -> int:
        return len(self.doc) - self.offset

    def vision_between(self, a: int, b: int) -> int:
        """Vision (placeholder) tokens among the document's tokens `a .. b - 1`."""
        return sum(max(0, min(b, u.end) - max(a, u.start)) for u in self.units)

    @property
    def remaining_vision(self) -> int:
        return self.vision_between(self.offset, len(self.doc))


class _Rows:
    """Rows being filled: a list of segments (ids, labels, media units), row by row."""

    def __init__(self, rows: int, seq_len: int, pad_id: int):
        self.rows, self.seq_len, self.pad_id = rows, seq_len, pad_id
        self.segments: list[tuple[list[int], list[int], list[_Unit]]] = []
        self.row = 0
        self.pos = 0
        self.vision_tokens = 0

    @property
    def done(self) -> bool:
        return self.row >= self.rows

    @property
    def space(self) -> int:
        return self.seq_len - self.pos

    def fits(self, cur: _Cursor) -> bool:
        """Whether (a piece of) `cur` can go at the current position: splittable documents always can, others
        when they fit in the rest of the row or the row is empty (a document longer than a row is cut)."""
        return cur.doc.splittable or cur.remaining <= self.space or self.pos == 0

    def _add(self, ids: list[int], labels: list[int], units: list[_Unit]) -> None:
        self.segments.append((ids, labels, units))
        self.pos += len(ids)
        if self.pos == self.seq_len:
            self.row, self.pos = self.row + 1, 0

    def pad_row(self) -> None:
        """Fill the rest of the current row with one padding segment (nothing to do at a row start)."""
        if self.pos:
            n = self.space
            self._add([self.pad_id] * n, [IGNORE_INDEX] * n, [])

    def place(self, cur: _Cursor) -> None:
        """Place the next piece of `cur` (which must `fit`): all of it, or what fills the row."""
        take = min(cur.remaining, self.space)
        a, b = cur.offset, cur.offset + take
        units = []
        for u in cur.units:
            if u.start < b and u.end > a:
                if u.start < a or u.end > b:
                    what = "an image" if u.kind == "image" else "a video chunk"
                    raise ConfigError(
                        f"a document of {len(cur.doc)} tokens must be cut at token {b if u.end > b else a} "
                        f"(rows of seq_len={self.seq_len}), inside the placeholders of {what} (tokens "
                        f"{u.start}..{u.end}); raise seq_len or lower the processor's max_patches so that every "
                        "media block fits in one row.")
                units.append(u)
        self._add(cur.doc.input_ids[a:b], cur.doc.labels[a:b], units)
        self.vision_tokens += cur.vision_between(a, b)
        cur.offset = b

    def batch(self, ids: tuple[int, int, int]) -> PackedBatch:
        pad_id, image_id, video_id = ids
        input_ids = [t for s in self.segments for t in s[0]]
        labels = [t for s in self.segments for t in s[1]]
        cu = np.concatenate([[0], np.cumsum([len(s[0]) for s in self.segments])])
        units = [u for s in self.segments for u in s[2]]

        def gather(kind: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            chosen = [u for u in units if u.kind == kind]
            if not chosen:
                return None, None
            return torch.cat([u.pixels for u in chosen]), torch.stack([u.grid for u in chosen]).long()

        pv, ig = gather("image")
        pvv, vg = gather("video")
        return PackedBatch(
            input_ids=torch.tensor([input_ids], dtype=torch.long),
            labels=torch.tensor([labels], dtype=torch.long),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            pixel_values=pv, image_grid_thw=ig, pixel_values_videos=pvv, video_grid_thw=vg,
            rows=self.rows, seq_len=self.seq_len, pad_token_id=pad_id, image_token_id=image_id,
            video_token_id=video_id,
        )


class _Queue:
    """Documents drawn from one source and not placed yet, oldest first, with a per-row budget of draws that
    did not fit (so that filling a gap cannot draw forever)."""

    def __init__(self, source: Callable[[random.Random], Document], token_ids: tuple[int, int, int],
                 max_misses: int):
        self.source, self.token_ids, self.max_misses = source, token_ids, max_misses
        self.items: list[_Cursor] = []
        self.row = -1
        self.misses = 0

    def draw(self, rng: random.Random) -> _Cursor:
        doc = self.source(rng)
        if not isinstance(doc, Document):
            raise ConfigError(f"a document source returned a {type(doc).__name__}, not a Document.")
        cur = _Cursor(doc, self.token_ids[1], self.token_ids[2])
        self.items.append(cur)
        return cur

    def take(self, out: _Rows, rng: random.Random, accept: Callable[[_Cursor], bool] = lambda cur: True
             ) -> _Cursor | None:
        """The oldest queued document that fits at the cursor and is accepted; else new draws, up to the row's
        budget of misses; None when nothing fits."""
        if self.row != out.row:
            self.row, self.misses = out.row, 0
        for cur in self.items:
            if out.fits(cur) and accept(cur):
                return cur
        while self.misses <= self.max_misses:
            cur = self.draw(rng)
            if out.fits(cur) and accept(cur):
                return cur
            self.misses += 1
        return None

    def place(self, out: _Rows, cur: _Cursor) -> None:
        out.place(cur)
        if cur.remaining == 0:
            self.items.remove(cur)


class PackedStream:
    """A deterministic, resumable stream of `PackedBatch`es: `batch(i)` is a pure function of `(seed, i)`.

    Args:
        documents: draws one document from the given `random.Random` (with `vision_ratio`: the text documents).
        seq_len: tokens per row.
        rows: rows per batch.
        seed: stream seed.
        vision_ratio: None to pack `documents` only; else the fraction of each batch's tokens that are vision
            (placeholder) tokens, taken from `vision_documents`.
        vision_documents: draws one document with media (required with `vision_ratio`).
        processor: a `KimiVLProcessor` (or tokenizer) whose pad / image / video token ids the batches use; None:
            the ids `build_tokenizer` assigns.
        max_misses: how many drawn documents may fail to fit in a row's gap before the gap is padded (non-splittable
            documents) or left to text (vision documents); the documents that did not fit are placed later.
    """

    def __init__(
        self,
        documents: Callable[[random.Random], Document],
        *,
        seq_len: int,
        rows: int,
        seed: int,
        vision_ratio: float | None = None,
        vision_documents: Callable[[random.Random], Document] | None = None,
        processor: Any = None,
        max_misses: int = 2,
    ):
        if seq_len < 1 or rows < 1:
            raise ConfigError(f"seq_len and rows must be positive, got seq_len={seq_len}, rows={rows}.")
        if vision_ratio is not None:
            if not 0.0 <= vision_ratio <= 1.0:
                raise ConfigError(f"vision_ratio must be in [0, 1], got {vision_ratio}.")
            if vision_documents is None:
                raise ConfigError("vision_ratio needs vision_documents (a source of documents with media).")
        if max_misses < 0:
            raise ConfigError(f"max_misses must be >= 0, got {max_misses}.")
        self.documents = documents
        self.vision_documents = vision_documents
        self.seq_len, self.rows, self.seed = int(seq_len), int(rows), int(seed)
        self.vision_ratio = vision_ratio
        self.max_misses = int(max_misses)
        if processor is None:
            self.token_ids = (SPECIAL_TOKENS.index(PAD), SPECIAL_TOKENS.index(MEDIA_PAD),
                              SPECIAL_TOKENS.index(VIDEO_PLACEHOLDER))
        else:
            self.token_ids = tuple(_ids(_tokenizer(processor), (PAD, MEDIA_PAD, VIDEO_PLACEHOLDER)))

    def rng(self, index: int) -> random.Random:
        """The random generator batch `index` draws from."""
        return random.Random(f"packed:{self.seed}:{int(index)}")

    def batch(self, index: int) -> PackedBatch:
        """Batch `index` (any non-negative int; batches are independent of each other)."""
        if index < 0:
            raise ConfigError(f"batch index must be >= 0, got {index}.")
        rng = self.rng(index)
        out = _Rows(self.rows, self.seq_len, self.token_ids[0])
        texts = _Queue(self.documents, self.token_ids, self.max_misses)
        visions = _Queue(self.vision_documents, self.token_ids, self.max_misses) if self.vision_ratio is not None \
            else None
        while not out.done:
            if visions is not None and self._place_vision(out, visions, rng):
                continue
            cur = texts.take(out, rng)
            if cur is None:
                out.pad_row()
            else:
                texts.place(out, cur)
        return out.batch(self.token_ids)

    def _place_vision(self, out: _Rows, visions: _Queue, rng: random.Random) -> bool:
        """Place a vision document when that brings the batch's vision tokens closer to the ratio's goal for the
        end of the current row; False when none should or can go here."""
        started = next((c for c in visions.items if c.offset > 0), None)
        if started is not None:  # the rest of a document longer than a row
            visions.place(out, started)
            return True
        # aim half a row ahead, so that a late document too long for the rest of a row (a screencast) does not
        # leave the batch short of vision tokens
        goal = self.vision_ratio * min(self.rows, out.row + 1.5) * self.seq_len
        deficit = goal - out.vision_tokens
        if deficit <= 0:
            return False
        # |V + v - goal| < |V - goal|  <=>  0 < v < 2 * deficit
        cur = visions.take(out, rng, accept=lambda c: 0 < c.remaining_vision < 2 * deficit)
        if cur is None:
            return False
        visions.place(out, cur)
        return True


# ----------------------------------------------------------------------------------------------------------- streams
def stdlib_document(rng: random.Random, tokenizer: Any, num_chars: int) -> Document:
    """A splittable document from a random standard library excerpt of about `num_chars` characters: `[BOS]`
    excerpt, plus `[EOS]` when the excerpt reaches the end of its file."""
    tok = _tokenizer(tokenizer)
    text, at_end = stdlib_window(rng, num_chars)
    bos, eos = _ids(tok, (BOS, DOC_EOS))
    ids = [bos, *tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]] + ([eos] if at_end
                                                                                                  else [])
    return Document(ids, [IGNORE_INDEX, *ids[1:]], splittable=True)


def _task_picker(tasks: tuple[str, ...], weights: dict[str, float] | None, name: str
                 ) -> Callable[[random.Random], str]:
    """`rng -> task`: uniform over `tasks` (`rng.choice`) when `weights` is None, else drawn with `weights` (tasks
    left out have weight 0)."""
    if weights is None:
        return lambda rng: rng.choice(tasks)
    unknown = sorted(set(weights) - set(tasks))
    if unknown or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ConfigError(f"{name} must map some of {', '.join(tasks)} to weights >= 0 with a positive sum; got "
                          f"{weights!r}.")
    names = [t for t in tasks if weights.get(t, 0) > 0]
    cumulative = list(itertools.accumulate(weights[t] for t in names))
    return lambda rng: rng.choices(names, cum_weights=cumulative)[0]


def option_drill_document(rng: random.Random, processor: Any, lookups: int = 3, min_options: int = 10) -> Document:
    """The option-letter drill in its barest form: the options of a world `mc` question (its first k, k drawn in
    `min_options .. 10`: fewer options make an easier start), then `lookups` of them (distinct, random order) as
    "The option 42 is (C)." sentences, with the loss on the looked-up letters only (everything else is a random
    draw or a copy; the letter is the one thing to learn). Not splittable.

    `[BOS]Options:\nA. ...\nJ. ...\nThe option 42 is (C). The option red is (A). ...[EOS]`
    """
    tok = _tokenizer(processor)
    bos, eos = _ids(tok, (BOS, DOC_EOS))
    options = make_sample("mc", rng).choices or []
    if min_options < len(options):  # fewer options: an easier start for the drill
        options = options[: rng.randint(min_options, len(options))]
    picks = rng.sample(range(len(options)), min(lookups, len(options)))
    ids = [bos] + tok(options_block(options) + "\n", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    close = tok(").", add_special_tokens=False)["input_ids"]
    for k, i in enumerate(picks):
        sentence = option_lookup(options[i], LETTERS[i])  # "The option 42 is (C).": the letter is the target
        query = tok(("" if k == 0 else " ") + sentence[: sentence.rindex("(") + 1], add_special_tokens=False,
                    split_special_tokens=True)["input_ids"]
        letter = tok(LETTERS[i], add_special_tokens=False)["input_ids"]
        ids += query + letter + close
        labels += [IGNORE_INDEX] * len(query) + letter + [IGNORE_INDEX] * len(close)
    ids.append(eos)
    labels.append(IGNORE_INDEX)
    return Document(ids, labels)


def pretrain_stream(
    processor: Any,
    *,
    seq_len: int,
    rows: int,
    seed: int,
    vision_ratio: float = 0.25,
    video_fraction: float = 0.1,
    chat_fraction: float = 0.25,
    code_fraction: float = 0.5,
    text_chat_fraction: float = 0.0,
    text_tasks: dict[str, float] | None = None,
    vision_tasks: dict[str, float] | None = None,
    drill_batches: int = 0,
    drill_lookups: int = 5,
    drill_min_options: int = 3,
) -> PackedStream | WarmupStream:
    """The joint text-vision pre-training stream (embedded data only).

    Text documents: with probability `code_fraction` a standard library excerpt (about `4 * seq_len`
    characters), else a world text sample (`TEXT_TASKS`, drawn with the weights `text_tasks`, uniformly when
    None), in chat form with probability `text_chat_fraction` (loss on the reply; not splittable) else in
    pre-training form (splittable). Vision documents: a world sample with media: a screencast with
    probability `video_fraction`, else an image task (`VISION_TASKS`, weights `vision_tasks`, uniform when None),
    in chat form with probability `chat_fraction` (loss on the reply) else in pre-training form (loss on the text
    after the media). `vision_ratio` of every batch's tokens are vision tokens.

    With `drill_batches > 0` the stream is a `WarmupStream`: in its first `drill_batches` batches every text
    document is an option-letter drill (`option_drill_document` with `drill_lookups` lookups among
    `drill_min_options` to 10 options), and the vision documents are image tasks in chat form (loss on their short
    replies only, no screencasts), at the same vision ratio. Finding an option's letter from its value is the last
    step of every multiple-choice answer; in the mixture alone a tiny model does not learn it within the
    quickstart's minutes (its letters are a few tokens among many), after the drill it keeps the skill and applies
    it to the mixture's questions.
    """
    for name, value in (("video_fraction", video_fraction), ("chat_fraction", chat_fraction),
                        ("code_fraction", code_fraction), ("text_chat_fraction", text_chat_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {value}.")
    pick_text = _task_picker(TEXT_TASKS, text_tasks, "text_tasks")
    pick_vision = _task_picker(VISION_TASKS, vision_tasks, "vision_tasks")

    def text_doc(rng: random.Random) -> Document:
        if rng.random() < code_fraction:
            return stdlib_document(rng, processor, 4 * seq_len)
        sample = make_sample(pick_text(rng), rng)
        return encode_sample(sample, processor, chat=text_chat_fraction > 0 and rng.random() < text_chat_fraction)

    def vision_doc(rng: random.Random) -> Document:
        task = rng.choice(VIDEO_TASKS) if rng.random() < video_fraction else pick_vision(rng)
        chat = rng.random() < chat_fraction
        return encode_sample(make_sample(task, rng), processor, chat=chat)

    main = PackedStream(text_doc, seq_len=seq_len, rows=rows, seed=seed, vision_ratio=vision_ratio,
                        vision_documents=vision_doc, processor=processor)
    if drill_batches < 0 or drill_lookups < 1:
        raise ConfigError(f"drill_batches must be >= 0 and drill_lookups >= 1, got {drill_batches}, {drill_lookups}.")
    if not drill_batches:
        return main

    def drill_vision_doc(rng: random.Random) -> Document:  # short replies: the letters keep their share of the loss
        return encode_sample(make_sample(pick_vision(rng), rng), processor, chat=True)

    drill = PackedStream(lambda rng: option_drill_document(rng, processor, drill_lookups, drill_min_options),
                         seq_len=seq_len, rows=rows, seed=seed, vision_ratio=vision_ratio,
                         vision_documents=drill_vision_doc, processor=processor, max_misses=6)
    return WarmupStream(drill, main, drill_batches)


class WarmupStream:
    """Batches `0 .. warmup_batches - 1` from `warmup`, the later ones from `main` (each a pure function of its
    index, so a resumed run sees the same batches). `main` is the stream's steady state: baselines and validation
    use it."""

    def __init__(self, warmup: PackedStream, main: PackedStream, warmup_batches: int) -> None:
        self.warmup, self.main, self.warmup_batches = warmup, main, int(warmup_batches)

    def batch(self, index: int) -> PackedBatch:
        return (self.warmup if index < self.warmup_batches else self.main).batch(index)


def sft_stream(processor: Any, seq_len: int, rows: int, seed: int = 0, *, max_misses: int = 6) -> PackedStream:
    """The zero-vision SFT stream: text-only conversations (`sft.sft_conversation`) packed whole, loss on the
    assistant turns only. Never holds a media token (`ConfigError` if a conversation would). `max_misses`
    conversations may be drawn per row to fill its gap before the gap is padded."""
    from .sft import sft_conversation

    image_id, video_id = _ids(_tokenizer(processor), (MEDIA_PAD, VIDEO_PLACEHOLDER))

    def chat_doc(rng: random.Random) -> Document:
        doc = encode_chat(sft_conversation(rng), processor)
        if doc.media or image_id in doc.input_ids or video_id in doc.input_ids:
            raise ConfigError("a zero-vision SFT conversation produced media tokens; SFT data must be text only.")
        return doc

    return PackedStream(chat_doc, seq_len=seq_len, rows=rows, seed=seed, processor=processor, max_misses=max_misses)


__all__ = [
    "IGNORE_INDEX", "Document", "PackedBatch", "PackedStream", "WarmupStream", "assistant_mask", "encode_chat",
    "encode_sample", "encode_text", "option_drill_document", "pretrain_stream", "sft_stream", "stdlib_document",
]
