"""Packing documents into fixed-size rows for `KimiVLForConditionalGeneration` with `cu_seqlens`.

`PackedStream.batch(i)`: `rows` rows of exactly `seq_len` tokens laid end to end in one `[1, rows * seq_len]`
sequence. Every document (or piece of one) is its own `cu_seqlens` segment, and every row boundary is a segment
boundary. Placement, row by row:
- a splittable document (plain text) fills the rest of the current row and continues in the next row;
- any other document is placed whole. One that does not fit in the rest of the row waits for the next row (it is
  the first candidate there), and up to `max_misses` further drawn documents are tried in the gap; when none fits,
  the rest of the row becomes padding (`[PAD]` ids, labels -100, its own segment). Waiting documents are placed
  oldest first;
- a document longer than a row is cut into pieces starting at row beginnings; a cut never falls inside an image or
  a video chunk (nor inside the timestamp written before the chunk, with the processor's tokenizer): the piece then
  ends before that block and the rest of its row is padding (a single block longer
  than a row is refused with `ConfigError` when drawn);
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
vision tokens as whole vision documents allow. A document without media drawn from the vision source goes to the
text documents (user data sources may mix both kinds).

Document sources are callables `draws -> Document` taking the batch's `BatchDraws`: its random generator
(`draws.rng`), its index, and where sources record what they drew (documents per source, bad records skipped).

Determinism: `batch(i)` draws everything from `random.Random(f"packed:{seed}:{i}")`, so it is a pure function of
`(seed, i)` (resuming at any step reproduces the same data) and batches can be built in any order.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, InvalidMediaError
from ..fusion.placeholders import format_timestamp
from ..text.modeling import next_token_targets
from ..tokenization.special_tokens import MEDIA_PAD, MEDIA_START, PAD, SPECIAL_TOKENS, VIDEO_PLACEHOLDER
from .encode import IGNORE_INDEX, MEDIA_KEYS, Document, special_ids, tokenizer_of


@dataclass
class BatchDraws:
    """The drawing context of one batch, handed to document sources.

    Attributes:
        index: the batch index.
        rng: the batch's random generator (every random choice of the batch comes from it).
        documents: documents drawn per source name (sources that name themselves).
        bad_records: records skipped as bad, one dict each (`source`, `file`, `row`, `reason`).
        state: per-batch bookkeeping of the sources (e.g. their read positions), keyed by source.
    """

    index: int
    rng: random.Random
    documents: Counter = field(default_factory=Counter)
    bad_records: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


DocumentSource = Callable[[BatchDraws], Document]
"""Draws one document for the batch being built."""


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
        documents: documents drawn per source name while the batch was built (named sources only).
        bad_records: records skipped as bad while the batch was built (`source`, `file`, `row`, `reason`).
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
    documents: dict[str, int] = field(default_factory=dict)
    bad_records: list[dict[str, Any]] = field(default_factory=list)

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
        """Tokens the loss averages over (`causal_lm_loss`'s targets with a label)."""
        return int((next_token_targets(self.labels, self.cu_seqlens) != IGNORE_INDEX).sum())

    @property
    def num_vision_tokens(self) -> int:
        """Image and video placeholder tokens (one per merged vision token fed to the backbone)."""
        ids = self.input_ids
        return int(((ids == self.image_token_id) | (ids == self.video_token_id)).sum())


@dataclass
class _Unit:
    """One image or one video chunk of a document: its placeholder run `[start, end)`, the start of its block
    (the `<|media_start|>` that opens it; a video chunk's timestamp before it), and its tensors."""

    kind: str  # "image" | "video"
    start: int
    end: int
    pixels: torch.Tensor
    grid: torch.Tensor
    block_start: int


_MAX_BLOCK_HEADER = 8
"""Most tokens between a block's `<|media_start|>` and its placeholders (`image` / `video`, `<|media_content|>`)."""
_TIMESTAMP_CHARS = len(format_timestamp(0.0))
"""Characters of the `HH:MM:SS.mmm` timestamp before each video chunk's `<|media_start|>`."""


def _block_start(ids: list[int], start: int, media_start_id: int, timestamp_of: Any = None) -> int:
    """Where the block of the placeholder run starting at `start` begins: its `<|media_start|>`, or with a
    `timestamp_of` tokenizer (a video chunk) the first token of the `HH:MM:SS.mmm` timestamp written before it."""
    for i in range(start - 1, max(-1, start - 1 - _MAX_BLOCK_HEADER), -1):
        if ids[i] == media_start_id:
            j = i
            while timestamp_of is not None and j > 0 and len(timestamp_of.decode(ids[j:i])) < _TIMESTAMP_CHARS:
                j -= 1
            return j
    return start


def packing_ids(processor: Any = None) -> tuple[int, int, int, int]:
    """The pad, image placeholder, video placeholder and `<|media_start|>` ids of `processor` (a `KimiVLProcessor`
    or a tokenizer; None: the ids `build_tokenizer` assigns), as `media_units` and the packer take them."""
    tokens = (PAD, MEDIA_PAD, VIDEO_PLACEHOLDER, MEDIA_START)
    if processor is None:
        return tuple(SPECIAL_TOKENS.index(t) for t in tokens)
    return tuple(special_ids(processor, tokens))


def media_units(doc: Document, token_ids: tuple[int, int, int, int], tokenizer: Any = None) -> list[_Unit]:
    """The document's images and video chunks in token order, each matched to its placeholder run (`token_ids`:
    `packing_ids`). A unit's block, `block_start` to `end`, is what the packer never cuts between rows; with the
    document's `tokenizer`, a video chunk's block includes the timestamp before it."""
    image_id, video_id, media_start_id = token_ids[1:]
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
            units.append(_Unit(kind, start, end, doc.media[pix_key][offset:offset + size], grid,
                               _block_start(ids, start, media_start_id, tokenizer if kind == "video" else None)))
            offset += size
    units.sort(key=lambda u: u.start)
    return units


class _Cursor:
    """A document being placed: how much of it has been placed, its media units and its vision tokens."""

    def __init__(self, doc: Document, token_ids: tuple[int, int, int, int], tokenizer: Any = None):
        if len(doc) == 0:
            raise ConfigError("a document source returned an empty document; every document needs tokens.")
        self.doc = doc
        self.offset = 0
        self.units = media_units(doc, token_ids, tokenizer) if doc.media else []
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
        """Place the next piece of `cur` (which must `fit`): all of it, or what fills the row. A cut that would fall
        inside an image or video block ends the piece before the block and pads the rest of the row."""
        a = cur.offset
        b = a + min(cur.remaining, self.space)
        for u in cur.units:
            if u.block_start < b < u.end:
                b = u.block_start
        units = [u for u in cur.units if a <= u.start and u.end <= b]
        self._add(cur.doc.input_ids[a:b], cur.doc.labels[a:b], units)
        self.vision_tokens += cur.vision_between(a, b)
        cur.offset = b
        if cur.remaining:
            self.pad_row()

    def batch(self, ids: tuple[int, int, int, int], draws: BatchDraws) -> PackedBatch:
        pad_id, image_id, video_id, _ = ids
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
            video_token_id=video_id, documents=dict(draws.documents), bad_records=list(draws.bad_records),
        )


class _Queue:
    """Documents drawn from one source and not placed yet, oldest first, with a per-row budget of draws that
    did not fit (so that filling a gap cannot draw forever). With `overflow`, drawn documents without media go to
    that queue instead (a vision source whose records may lack media)."""

    def __init__(self, source: DocumentSource, token_ids: tuple[int, int, int, int], max_misses: int, seq_len: int,
                 overflow: _Queue | None = None, tokenizer: Any = None):
        self.source, self.token_ids, self.max_misses, self.seq_len = source, token_ids, max_misses, seq_len
        self.tokenizer = tokenizer
        self.overflow = overflow
        self.items: list[_Cursor] = []
        self.row = -1
        self.misses = 0

    def draw(self, draws: BatchDraws) -> _Cursor:
        doc = self.source(draws)
        if not isinstance(doc, Document):
            raise ConfigError(f"a document source returned a {type(doc).__name__}, not a Document.")
        if doc.source:
            draws.documents[doc.source] += 1
        cur = _Cursor(doc, self.token_ids, self.tokenizer)
        for u in cur.units:
            if u.end - u.block_start > self.seq_len:
                what = "an image" if u.kind == "image" else "a video chunk"
                raise ConfigError(f"{what} of {u.end - u.start} vision tokens (a block of {u.end - u.block_start} "
                                  f"tokens) does not fit in a row of seq_len={self.seq_len}; raise seq_len or lower "
                                  "the processor's max_patches.")
        if self.overflow is not None and not cur.units:
            self.overflow.items.append(cur)
        else:
            self.items.append(cur)
        return cur

    def take(self, out: _Rows, draws: BatchDraws, accept: Callable[[_Cursor], bool] = lambda cur: True
             ) -> _Cursor | None:
        """The oldest queued document that fits at the cursor and is accepted; else new draws, up to the row's
        budget of misses; None when nothing fits."""
        if self.row != out.row:
            self.row, self.misses = out.row, 0
        for cur in self.items:
            if out.fits(cur) and accept(cur):
                return cur
        while self.misses <= self.max_misses:
            cur = self.draw(draws)
            if cur in self.items and out.fits(cur) and accept(cur):
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
        documents: draws one document for a batch (`DocumentSource`; with `vision_ratio`: the text documents).
        seq_len: tokens per row.
        rows: rows per batch.
        seed: stream seed.
        vision_ratio: None to pack `documents` only; else the fraction of each batch's tokens that are vision
            (placeholder) tokens, taken from `vision_documents`.
        vision_documents: draws one document with media (required with `vision_ratio`); documents it returns
            without media are used as text documents.
        processor: a `KimiVLProcessor` (or tokenizer) whose pad / image / video token ids the batches use; None:
            the ids `build_tokenizer` assigns.
        max_misses: how many drawn documents may fail to fit in a row's gap before the gap is padded (non-splittable
            documents) or left to text (vision documents); the documents that did not fit are placed later.
    """

    def __init__(
        self,
        documents: DocumentSource,
        *,
        seq_len: int,
        rows: int,
        seed: int,
        vision_ratio: float | None = None,
        vision_documents: DocumentSource | None = None,
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
        self.token_ids = packing_ids(processor)
        self.tokenizer = None if processor is None else tokenizer_of(processor)

    def rng(self, index: int) -> random.Random:
        """The random generator batch `index` draws from."""
        return random.Random(f"packed:{self.seed}:{int(index)}")

    def batch(self, index: int) -> PackedBatch:
        """Batch `index` (any non-negative int; batches are independent of each other)."""
        if index < 0:
            raise ConfigError(f"batch index must be >= 0, got {index}.")
        draws = BatchDraws(int(index), self.rng(index))
        out = _Rows(self.rows, self.seq_len, self.token_ids[0])
        texts = _Queue(self.documents, self.token_ids, self.max_misses, self.seq_len, tokenizer=self.tokenizer)
        visions = None if self.vision_ratio is None else _Queue(self.vision_documents, self.token_ids,
                                                                  self.max_misses, self.seq_len, overflow=texts,
                                                                  tokenizer=self.tokenizer)
        while not out.done:
            if visions is not None and self._place_vision(out, visions, draws):
                continue
            cur = texts.take(out, draws)
            if cur is None:
                out.pad_row()
            else:
                texts.place(out, cur)
        return out.batch(self.token_ids, draws)

    def _place_vision(self, out: _Rows, visions: _Queue, draws: BatchDraws) -> bool:
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
        cur = visions.take(out, draws, accept=lambda c: 0 < c.remaining_vision < 2 * deficit)
        if cur is None:
            return False
        visions.place(out, cur)
        return True




class WarmupStream:
    """Batches `0 .. warmup_batches - 1` from `warmup`, the later ones from `main` (each a pure function of its
    index, so a resumed run sees the same batches). `main` is the stream's steady state: baselines and validation
    use it."""

    def __init__(self, warmup: PackedStream, main: PackedStream, warmup_batches: int) -> None:
        self.warmup, self.main, self.warmup_batches = warmup, main, int(warmup_batches)

    def batch(self, index: int) -> PackedBatch:
        return (self.warmup if index < self.warmup_batches else self.main).batch(index)


__all__ = ["BatchDraws", "DocumentSource", "PackedBatch", "PackedStream", "WarmupStream", "media_units",
           "packing_ids"]
