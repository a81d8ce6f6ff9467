"""Mixing users' data sources: weighted draws, a shuffled read order, and bad records skipped deterministically.

Weights. Each draw picks a source with probability proportional to its weight (`SRC=WEIGHT`); without any weight,
proportional to the sources' record counts; when some sources have a weight, the others weigh 1. With a vision
ratio the sources split into media sources (some of their first records hold images or videos) and text sources,
the ratio sets the balance between the two groups, and the weights apply within each group.

Read order. Position `p` of a source of `N` records is record `shuffle_e(p mod N)` of epoch `e = p // N`, where
`shuffle_e` is a bijection of `[0, N)` seeded by `(seed, source, e)` (a Feistel network with cycle walking: nothing
of size N is stored). Batch `i` reads source `s` from position `floor(i * rate_s)` on, where `rate_s` is the
source's mean draws per batch (measured once on calibration batches; for RL, prompts per step times the source's
share), and its draws take each source's share of positions up to `floor((i + 1) * rate_s)` first, in a random
order (`Mixture.pick`), before any further draw picks by weight. Consecutive batches thus read consecutive stretches
of the shuffled order, so an epoch reads every record about once (batches that draw more or fewer documents than the
mean overlap or skip a few records at their edges), and batch `i` stays a pure function of `(seed, i)`: resuming
needs no loader state at any scale, with any number of data-loader workers or ranks. Streamed sources are read in
their own order (position `p` is row `p`).

Bad records. A record that cannot be parsed, whose media cannot be read, or that cannot be encoded into the rows (an
image longer than a row, a chat longer than a row: a chat is placed whole) is skipped and the source's next position
is drawn instead, so the batch stays deterministic; the skip is recorded on the batch (`source`, `file`, `row`,
`reason`). More than `max_bad_in_a_row` bad records in a row stop with `DataError`; with `strict` the first one does
(`BadRecordError`). A packed stream remembers the records it found bad, so drawing one again costs nothing. A
packed stream whose calibration batches hold no token with a loss stops with `DataError` (every step would be
skipped).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import BadRecordError, ConfigError, DataError
from .encode import Document, Prompt, encode_chat, encode_document, encode_prompt, tokenizer_of
from .formats import Format, Record, error_reason, get_format, parse_record
from .pack import BatchDraws, PackedStream, media_units, packing_ids
from .sources import Source

T = TypeVar("T")
_M64 = (1 << 64) - 1
CALIBRATION_BATCHES = 4
"""Batches built at start-up to measure each source's draws per batch."""
MEDIA_PROBE = 16
"""Records read per source at start-up to tell media sources from text sources."""
KNOWN_BAD_LIMIT = 65536
"""Bad records a packed stream remembers (`Mixture.draw`'s `known_bad`) before it forgets them all."""


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit function of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Shuffle:
    """A seeded bijection of `[0, n)`: a 4-round Feistel network on the smallest even number of bits covering `n`,
    applied again while the result is `>= n` (cycle walking; at most 4 rounds of it on average)."""

    def __init__(self, n: int, key: str) -> None:
        if n < 1:
            raise ConfigError("a shuffle needs at least one item.")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        seed = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little")
        self.keys = [_mix64(seed + r) for r in range(4)]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n}).")
        while True:
            left, right = i >> self.half, i & self.mask
            for k in self.keys:
                left, right = right, left ^ (_mix64(right ^ k) & self.mask)
            i = (left << self.half) | right
            if i < self.n:
                return i


@dataclass
class Group:
    """Sources drawn together, with their normalised draw probabilities."""

    sources: list[Source]
    probabilities: list[float]

    def pick(self, rng: random.Random) -> Source:
        return self.sources[0] if len(self.sources) == 1 else rng.choices(self.sources, self.probabilities)[0]


class Mixture:
    """Weighted users' sources read in shuffled order, records parsed and bad ones skipped (module docstring).

    Args:
        sources: the `--data` sources.
        seed: shuffles and draws depend on it.
        kinds: the record kinds the stage accepts ("document", "chat", "prompt").
        fmt: a format name for every record, or "auto" (each record's keys; `.txt` and `.tar` files have theirs).
        reward: the reward kind of every RL prompt (None: from each row's answer and data source).
        strict: stop at the first bad record.
        max_bad_in_a_row: more bad records in a row than this stop with `DataError`.
    """

    def __init__(self, sources: Sequence[Source], *, seed: int, kinds: Sequence[str], fmt: str = "auto",
                 reward: str | None = None, strict: bool = False, max_bad_in_a_row: int = 100) -> None:
        if not sources:
            raise ConfigError("no data sources; pass --data FILE|FOLDER|GLOB|hf:NAME (repeatable).")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"a data source is given twice: {sorted(n for n in names if names.count(n) > 1)}.")
        for s in sources:
            if len(s) == 0:
                raise DataError(f"data source {s.name} has no records.")
        if max_bad_in_a_row < 0:
            raise ConfigError(f"max_bad_in_a_row must be >= 0, got {max_bad_in_a_row}.")
        self.sources, self.seed, self.kinds = list(sources), int(seed), tuple(kinds)
        self.format: Format | None = None if fmt == "auto" else get_format(fmt)
        self.reward, self.strict, self.max_bad_in_a_row = reward, strict, max_bad_in_a_row
        self.weights = self._weights()
        self.rates: dict[str, float] = {s.name: 1.0 for s in self.sources}
        self.shares = False  # whether draws take each source's share of a batch first (`pick`): once rates are set
        self._shuffles: dict[tuple[str, int], Shuffle] = {}
        for s in self.sources:
            self._check_kind(s)

    def _weights(self) -> dict[str, float]:
        given = [s.weight for s in self.sources]
        if any(s.streaming for s in self.sources) and len(self.sources) > 1 and None in given:
            raise ConfigError("a streamed source has no known size: give every --data source a weight (SRC=W).")
        if all(w is None for w in given):
            weights = {s.name: float(len(s)) for s in self.sources}
        else:
            weights = {s.name: 1.0 if s.weight is None else s.weight for s in self.sources}
        if sum(weights.values()) <= 0:
            raise ConfigError("the data sources' weights sum to 0; give at least one a positive weight.")
        return weights

    def _check_kind(self, source: Source) -> None:
        """Refuse a source whose first readable record is of a kind the stage does not train on."""
        for i in range(min(len(source), 8)):
            try:
                record = self._record(source, i)
            except BadRecordError:
                continue
            if record.kind not in self.kinds:
                raise ConfigError(f"data source {source.name} holds {record.kind}s, but this stage trains on "
                                  f"{' and '.join(k + 's' for k in self.kinds)}; see `kimi-vl data check` and the "
                                  "README's data schemas.")
            return

    def group(self, sources: Sequence[Source]) -> Group:
        total = sum(self.weights[s.name] for s in sources)
        return Group(list(sources), [self.weights[s.name] / total for s in sources])

    def media_sources(self) -> list[Source]:
        """Sources among whose first `MEDIA_PROBE` records one has an image or a video."""
        out = []
        for s in self.sources:
            for i in range(min(len(s), MEDIA_PROBE)):
                try:
                    if self._parse(s, i).media():
                        out.append(s)
                        break
                except BadRecordError:
                    continue
        return out

    # -- reading ----------------------------------------------------------------------------------------------------
    def record_index(self, source: Source, position: int) -> int:
        """The record at `position` of the source's shuffled read order."""
        if source.streaming:
            return position
        n = len(source)
        epoch, k = divmod(position, n)
        key = (source.name, epoch)
        if key not in self._shuffles:
            if len(self._shuffles) > 64:
                self._shuffles.clear()
            self._shuffles[key] = Shuffle(n, f"{self.seed}:{source.name}:{epoch}")
        return self._shuffles[key](k)

    def _record(self, source: Source, index: int) -> Record:
        row, reader, base = source.read(index)
        fmt = self.format or (get_format(reader.format_hint) if reader.format_hint else None)
        return parse_record(row, fmt, base, reward=self.reward)

    def _parse(self, source: Source, index: int) -> Record:
        """The record at `index`, which must be of a kind the stage trains on (`BadRecordError` otherwise)."""
        record = self._record(source, index)
        if record.kind not in self.kinds:
            raise BadRecordError(f"a {record.kind} record in data for {' and '.join(self.kinds)}s")
        return record

    def draw(self, draws: BatchDraws, group: Group, make: Callable[[Record], T],
             known_bad: dict[tuple[str, int], str] | None = None) -> tuple[T, Source]:
        """`make(record)` for the next good record of a source picked from `group` (bad ones skipped and recorded
        on `draws`), and that source. `known_bad`: `(source, index) -> reason` of records this `make` already
        found bad (filled here), so that a bad record drawn again is skipped without being read and encoded again
        (the same outcome: reading is deterministic)."""
        source = self.pick(draws, group)
        start = math.floor(draws.index * self.rates[source.name])
        bad = 0
        while True:
            position = draws.state.get(source.name, start)
            draws.state[source.name] = position + 1
            index = self.record_index(source, position)
            key = (source.name, index)
            try:
                if known_bad is not None and key in known_bad:
                    raise BadRecordError(known_bad[key])
                return make(self._parse(source, index)), source
            except (ConfigError, DataError) as exc:
                if not isinstance(exc, BadRecordError):
                    raise
                reason = exc.reason
            except Exception as exc:  # an unreadable record must not stop the run: it is logged and replaced
                reason = error_reason(exc)
            if known_bad is not None:
                if len(known_bad) >= KNOWN_BAD_LIMIT:
                    known_bad.clear()
                known_bad[key] = reason
            file, row = source.where(index)
            if self.strict:
                raise BadRecordError(f"{reason} (--strict stops at the first bad record)", file, row)
            draws.bad_records.append({"source": source.name, "file": file, "row": row, "reason": reason})
            bad += 1
            if bad > self.max_bad_in_a_row:
                raise DataError(f"more than {self.max_bad_in_a_row} bad records in a row in data source "
                                f"{source.name} (the last: {file}:{row}: {reason}); run `kimi-vl data check "
                                f"{source.name}` to list them.")

    def pick(self, draws: BatchDraws, group: Group) -> Source:
        """The source of the next draw of batch `draws.index` from `group`. Batch `i`'s share of a source is its
        positions from `floor(i * rate)` up to `floor((i + 1) * rate)`, where batch `i + 1` starts: while sources of
        the group have some of their share left, one of them, in proportion to what each has left, so that the batch
        reads its shares (in a random order) and each source goes on where the previous batch left it, whatever the
        group's other draws; after that (or before the rates are measured), one by the group's probabilities."""
        if self.shares and len(group.sources) > 1:
            left = []
            for s in group.sources:
                rate = self.rates[s.name]
                end = math.floor((draws.index + 1) * rate)
                left.append(max(0, end - draws.state.get(s.name, math.floor(draws.index * rate))))
            if any(left):
                return draws.rng.choices(group.sources, left)[0]
        return group.pick(draws.rng)

    def calibrate(self, build: Callable[[int], Any], groups: Sequence[Group]) -> None:
        """Set each source's draws per batch from `CALIBRATION_BATCHES` batches `build(i)` (read far apart, the
        sources picked by their probabilities alone): a group's mean draws per batch times the source's probability
        in it."""
        far = {s.name: float(max(len(s), 1)) if not s.streaming else 0.0 for s in self.sources}
        self.rates, self.shares = far, False
        drawn: Counter = Counter()
        for i in range(CALIBRATION_BATCHES):
            batch = build(i)
            drawn.update(batch.documents)
            drawn.update(r["source"] for r in batch.bad_records)
        rates = {}
        for g in groups:
            per_batch = sum(drawn[s.name] for s in g.sources) / CALIBRATION_BATCHES
            for s, p in zip(g.sources, g.probabilities):
                rates[s.name] = per_batch * p
        self.rates, self.shares = rates, True

    def texts(self, n: int) -> list[str]:
        """About `n` texts drawn by weight (the shuffled order's first records; bad records skipped), to train a
        tokenizer on. A source read to its end is not drawn again: the others, by weight, give the rest."""
        rng = random.Random(f"texts:{self.seed}")
        live = list(self.sources)
        positions: Counter = Counter()
        out: list[str] = []
        for _ in range(n * 2):
            if len(out) >= n or sum(self.weights[s.name] for s in live) <= 0:
                break
            source = self.group(live).pick(rng)
            index = self.record_index(source, positions[source.name])
            positions[source.name] += 1
            if not source.streaming and positions[source.name] >= len(source):
                live.remove(source)
            try:
                text = self._parse(source, index).text()
            except BadRecordError:
                continue
            if text:
                out.append(text)
        return out

    def fingerprint(self) -> dict[str, Any]:
        """The data specification a checkpoint records: each source's files and weight, the format, the seed, and
        once measured each source's draws per batch (`rates`: batch `i` reads from `floor(i * rate)`)."""
        return {"sources": [s.fingerprint() for s in self.sources], "format": self.format.name if self.format
                else "auto", "reward": self.reward, "seed": self.seed,
                **({"rates": dict(self.rates)} if self.shares else {})}


EMBEDDED = "embedded (standard library corpus + synthetic world)"


def _content(source: dict[str, Any]) -> list[str]:
    """What a fingerprinted source holds, whatever its path: its files' sizes and hashes (hub datasets: name, rows)."""
    return sorted(json.dumps({k: v for k, v in f.items() if k != "path"} if "sha1_ends" in f else f, sort_keys=True)
                  for f in source.get("files", []))


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two data fingerprints, one line per difference (empty: the same data). The sources'
    names (the paths as given) and order count: each source's read order is keyed by its name, and draws pick sources
    by their order; a source given under another path with the same files is named as such."""
    def describe(fp: dict[str, Any]) -> dict[str, Any]:
        return {s["name"]: s for s in fp.get("sources", [])} if fp.get("sources") else {EMBEDDED: {}}

    before, after = describe(old), describe(new)
    removed = [n for n in before if n not in after]
    added = [n for n in after if n not in before]
    lines = []
    for name in removed:
        same = next((n for n in added if before[name].get("files") and _content(after[n]) == _content(before[name])),
                    None)
        if same is None:
            lines.append(f"source {name} was removed")
            continue
        added.remove(same)
        lines.append(f"source {name} is given as {same}, the same files (each source's read order is keyed by the "
                     f"path as given: give it as {name} to resume exactly)")
    lines += [f"source {n} was added" for n in added]
    kept = [n for n in before if n in after]
    if kept != [n for n in after if n in before]:
        lines.append(f"the sources are in another order ({', '.join(kept)} before; draws pick sources by their order)")
    for name in kept:
        a, b = before[name], after[name]
        if a.get("weight") != b.get("weight"):
            lines.append(f"source {name}: weight {a.get('weight')} -> {b.get('weight')}")
        if a.get("media_root") != b.get("media_root"):
            lines.append(f"source {name}: media root {a.get('media_root')} -> {b.get('media_root')}")
        files_a = {f["path"]: f for f in a.get("files", [])}
        files_b = {f["path"]: f for f in b.get("files", [])}
        lines += [f"source {name}: file {p} was removed" for p in files_a if p not in files_b]
        lines += [f"source {name}: file {p} was added" for p in files_b if p not in files_a]
        for path in [p for p in files_b if p in files_a and files_a[p] != files_b[p]]:
            fa, fb = files_a[path], files_b[path]
            what = (f"size {fa.get('size')} -> {fb.get('size')} bytes" if fa.get("size") != fb.get("size")
                    else "its content changed")
            lines.append(f"source {name}: file {path}: {what}")
        rate_a, rate_b = old.get("rates", {}).get(name), new.get("rates", {}).get(name)
        if rate_a is not None and rate_b is not None and not math.isclose(rate_a, rate_b, rel_tol=1e-9):
            lines.append(f"source {name}: {rate_a:.4g} records drawn per batch -> {rate_b:.4g} (another --rows, "
                         "--seq-len, --vision-ratio or prompts per step: batch i reads the source from position i x "
                         "this rate, so the resumed run would skip or repeat records)")
    for key in ("format", "reward", "seed"):
        if old.get(key) != new.get(key):
            lines.append(f"{key}: {old.get(key)} -> {new.get(key)}")
    if "screencast_font" in old and old["screencast_font"] != new.get("screencast_font"):  # older ones: unknown
        lines.append(f"the embedded screencasts are drawn in {new.get('screencast_font')}, not "
                     f"{old['screencast_font']} (see the fonts installed)")
    return lines


# ------------------------------------------------------------------------------------------------------- documents
def media_block_too_long(tokens: int, seq_len: int, kind: str, header: int = 4) -> str | None:
    """Why an image or video chunk (`kind`) of `tokens` vision tokens cannot be trained on in rows of `seq_len`
    tokens (None when it fits with the `header` tokens that open its block: `<|media_start|>`, the kind's name as
    the tokenizer splits it, `<|media_content|>`; 4 when not known): a media block is never cut between rows."""
    if tokens + header <= seq_len:
        return None
    return (f"an {kind} of {tokens} vision tokens does not fit in a row of seq_len={seq_len}; raise seq_len or lower "
            "the processor's max_patches")


def check_media_blocks(doc: Document, seq_len: int, processor: Any) -> Document:
    """A bad-record error when one of the document's media blocks, as the packer measures it (`media_units`: its
    header tokens with the tokenizer of `processor`, a video chunk's timestamp among them, then its placeholders),
    is longer than a row."""
    if doc.media:
        for unit in media_units(doc, packing_ids(processor), tokenizer_of(processor)):
            kind = "image" if unit.kind == "image" else "video chunk"
            if reason := media_block_too_long(unit.end - unit.start, seq_len, kind, unit.start - unit.block_start):
                raise BadRecordError(reason)
    return doc


def chat_too_long(tokens: int, seq_len: int, *, estimated: bool = False) -> str | None:
    """Why a chat of `tokens` tokens cannot be trained on in rows of `seq_len` tokens (None when it fits). Packing
    places a chat whole in one row; cutting it would lose its end (the assistant reply, the loss) to the next row."""
    if tokens <= seq_len:
        return None
    count = f"~{tokens:,} tokens (estimated; --tokenizer DIR counts them)" if estimated else f"{tokens:,} tokens"
    return (f"chat of {count} does not fit a row of seq_len={seq_len} (a chat is packed whole); raise --seq-len or "
            "shorten it")


def encode_record(record: Record, processor: Any, seq_len: int) -> Document:
    """A document or chat record (media read) as a training `Document` that fits the rows: a chat longer than a row
    and a media block longer than a row are bad records (an interleaved document longer than a row is cut into
    pieces by the packer, each trained on)."""
    if record.kind == "document":
        doc = encode_document(record.loaded(), processor)
    elif record.kind == "chat":
        doc = encode_chat(record.loaded(), processor)
        if (reason := chat_too_long(len(doc), seq_len)) is not None:
            raise BadRecordError(reason)
    else:
        raise BadRecordError(f"a {record.kind} record cannot be packed for training")
    return check_media_blocks(doc, seq_len, processor)


def mixture_stream(mixture: Mixture, processor: Any, *, seq_len: int, rows: int, seed: int,
                   vision_ratio: float | None = None, max_misses: int = 6) -> PackedStream:
    """A packed stream of the mixture's documents and chats, calibrated (see the module docstring). With a vision
    ratio and both media and text sources, media sources fill the vision share of every batch. Sources weighted 0
    are never drawn: they count as neither."""
    drawn = [s for s in mixture.sources if mixture.weights[s.name] > 0]
    media = [s for s in mixture.media_sources() if s in drawn] if vision_ratio is not None else []
    texts = [s for s in drawn if s not in media]
    ratio = vision_ratio if media and texts else None
    groups = [mixture.group(texts), mixture.group(media)] if ratio is not None else [mixture.group(drawn)]

    known_bad: dict[tuple[str, int], str] = {}

    def source(group: Group):
        def draw(draws: BatchDraws) -> Document:
            doc, src = mixture.draw(draws, group, lambda r: encode_record(r, processor, seq_len), known_bad)
            doc.source = src.name
            return doc
        return draw

    stream = PackedStream(source(groups[0]), seq_len=seq_len, rows=rows, seed=seed, vision_ratio=ratio,
                          vision_documents=source(groups[1]) if ratio is not None else None, processor=processor,
                          max_misses=max_misses)
    supervised = []

    def build(index: int) -> Any:
        batch = stream.batch(index)
        supervised.append(batch.num_loss_tokens)
        return batch

    mixture.calibrate(build, groups)
    if not any(supervised):
        names = ", ".join(s.name for s in mixture.sources)
        raise DataError(f"no token of {len(supervised)} batches of {names} carries a loss (every training step "
                        "would be skipped): documents train on their text and chats on their assistant replies; run "
                        f"`kimi-vl data check --tokenizer DIR {names}` to see what the records hold.")
    return stream


# ---------------------------------------------------------------------------------------------------------- prompts
class PromptStream:
    """RL prompts from a mixture: step `i` draws `per_step` prompts (media read), a pure function of `(seed, i)`.
    With the `processor` the rollouts encode them with, each drawn prompt is encoded once to check it, so that media
    only the processor reads (a video file that does not decode) make a bad record, replaced by the source's next
    record, rather than stop the run at its rollout.

    `prompts(step)` returns `(prompts, bad_records)`."""

    def __init__(self, mixture: Mixture, per_step: int, processor: Any = None) -> None:
        if per_step < 1:
            raise ConfigError(f"prompts per step must be >= 1, got {per_step}.")
        self.mixture, self.per_step, self.processor = mixture, per_step, processor
        self.group = mixture.group(mixture.sources)
        mixture.rates = {s.name: per_step * p for s, p in zip(self.group.sources, self.group.probabilities)}
        mixture.shares = True

    def _prompt(self, record: Record) -> Prompt:
        prompt = record.loaded()
        if self.processor is not None:
            encode_prompt(prompt, self.processor)
        return prompt

    def prompts(self, step: int) -> tuple[list[Prompt], list[dict[str, Any]]]:
        draws = BatchDraws(int(step), random.Random(f"prompts:{self.mixture.seed}:{int(step)}"))
        out = []
        for _ in range(self.per_step):
            prompt, source = self.mixture.draw(draws, self.group, self._prompt)
            prompt.source = source.name
            out.append(prompt)
        return out, draws.bad_records


__all__ = ["CALIBRATION_BATCHES", "EMBEDDED", "KNOWN_BAD_LIMIT", "Group", "Mixture", "PromptStream", "Shuffle",
           "chat_too_long", "check_media_blocks", "encode_record", "fingerprint_changes", "media_block_too_long",
           "mixture_stream"]
