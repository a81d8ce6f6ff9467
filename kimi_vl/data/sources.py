"""Data sources: random-access readers of users' files and Hugging Face datasets.

A `Source` is what one `--data SRC[=WEIGHT]` names: a file, a folder (its non-hidden data files, sorted), a glob, or
`hf:ORG/NAME[:CONFIG][@SPLIT]`. It has `len(source)` records and `source.read(i) -> (row, where)`; rows are never
all loaded. Each file is indexed once (where its records are) and the index is cached on disk under
`$KIMI_VL_CACHE/index` (default `~/.cache/kimi_vl/index`), keyed by the file's path, size and modification time:

- `.jsonl` (and `.json` not starting with `[`): one record per non-blank line; index: the lines' byte offsets
  (numpy over 16 MB blocks);
- `.json` starting with `[`: one record per array element; index: the elements' byte offsets, from a vectorised
  scan that tracks strings and escapes (a multi-GB LLaVA JSON is never parsed whole);
- `.parquet`: one record per row; index: an Arrow IPC copy in the cache, written row group by row group and read
  memory-mapped;
- `.tar` (WebDataset): one record per key (`dir/key.ext` members); index: each sample's header offset and member
  count (standard library `tarfile`);
- `.txt`: the whole file is one record;
- `hf:...`: one record per dataset row (the dataset's own memory-mapped Arrow files, `datasets.load_dataset`).
  Hub access fails fast as the eval data's does (`kimi_vl.eval.data.hub_reachable`): unless `HF_HUB_OFFLINE` /
  `HF_DATASETS_OFFLINE` is set (the local cache only), the hub endpoint is probed with a 3 s socket timeout first, and
  an unreachable hub is a `DataError` at once rather than `datasets`' retries.

`where` is `(file, row)` for error messages: 1-based line numbers in JSONL, 0-based element / row indices in JSON
arrays, Parquet and datasets, the sample key in tar shards.

Streaming (`streaming=True`, for `hf:` sets too large to download): the dataset is read in its own order,
sequentially; `read(i)` for a position more than `StreamingHubDataset.RECENT_ROWS` behind the stream re-reads it
from the start. Resume is still exact (the same positions give the same rows) but it re-reads every row up to the
resume position, in every data-loader worker and rank; prefer a downloaded dataset for long runs.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import json
import math
import os
import tarfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadRecordError, ConfigError, DataError

DATA_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".tar", ".txt")
BLOCK = 1 << 24  # bytes per read while indexing


def cache_dir() -> Path:
    """Where file indexes are cached: `$KIMI_VL_CACHE/index`, default `~/.cache/kimi_vl/index`."""
    root = os.environ.get("KIMI_VL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kimi_vl")
    return Path(root) / "index"


def _cache_path(path: Path, kind: str, suffix: str = ".npy") -> Path:
    st = path.stat()
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / f"{key}-{st.st_size}-{st.st_mtime_ns}.{kind}{suffix}"


def _cached_index(path: Path, kind: str, build) -> np.ndarray:
    """The index `build(path)` of `path`, read from the cache when the file has not changed since it was built."""
    target = _cache_path(path, kind)
    if target.is_file():
        try:
            return np.load(target)
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it
    index = build(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, index)
    os.replace(tmp, target)
    return index


class _Handle:
    """A binary file opened lazily in each process (data-loader workers are forked)."""

    def __init__(self, path: Path) -> None:
        self.path, self._file, self._pid = path, None, None

    def get(self):
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb"), os.getpid()  # noqa: SIM115 (kept open for reads)
        return self._file

    def __getstate__(self) -> dict:
        return {"path": self.path, "_file": None, "_pid": None}


# --------------------------------------------------------------------------------------------------------- JSON lines
def jsonl_spans(path: Path) -> np.ndarray:
    """`[n, 3]` int64: byte range `[start, end)` and 1-based line number of each non-blank line of a JSONL file."""
    newlines = []
    with open(path, "rb") as f:
        offset = 0
        while block := f.read(BLOCK):
            newlines.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + offset)
            offset += len(block)
    nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    ends = np.concatenate([nl, [offset]]).astype(np.int64)
    spans = np.stack([starts, ends, np.arange(1, len(starts) + 1)], axis=1)
    short = np.flatnonzero(spans[:, 1] - spans[:, 0] <= 16)
    if len(short):  # drop blank (whitespace-only) lines; only short lines can be blank in practice
        with open(path, "rb") as f:
            blank = []
            for i in short:
                f.seek(spans[i, 0])
                if not f.read(spans[i, 1] - spans[i, 0]).strip():
                    blank.append(i)
        spans = np.delete(spans, blank, axis=0)
    return spans


class JsonlFile:
    """Records of a JSONL file (one JSON object per non-blank line)."""

    format_hint = None

    def __init__(self, path: Path) -> None:
        self.path, self.spans, self._file = path, _cached_index(path, "jsonl", jsonl_spans), _Handle(path)

    def __len__(self) -> int:
        return len(self.spans)

    def raw(self, i: int) -> bytes:
        start, end = self.spans[i, :2]
        f = self._file.get()
        f.seek(int(start))
        return f.read(int(end - start))

    def read(self, i: int) -> Any:
        data = self.raw(i)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise BadRecordError(f"malformed JSON ({exc})") from exc

    def where(self, i: int) -> int:
        """The record's 1-based line number."""
        return int(self.spans[i, 2])


# --------------------------------------------------------------------------------------------------------- JSON array
def json_array_spans(path: Path) -> np.ndarray:
    """`[n, 2]` int64 byte ranges of the elements of a top-level JSON array, found without parsing it: quotes not
    escaped by an odd run of backslashes open and close strings; outside strings, `[ {` / `] }` change the depth,
    and the commas at depth 1 separate the elements. `DataError` when the file is not a JSON array."""
    in_string, depth, run_carry, offset = 0, 0, 0, 0
    bounds: list[np.ndarray] = []
    opened = closed = False
    with open(path, "rb") as f:
        while block := f.read(BLOCK // 4):
            a = np.frombuffer(block, dtype=np.uint8)
            n = len(a)
            idx = np.arange(n)
            backslash = a == 92
            last_other = np.maximum.accumulate(np.where(~backslash, idx, -1))
            quotes = np.flatnonzero(a == 34)
            prev = quotes - 1
            run = np.where(prev >= 0, prev - last_other[np.maximum(prev, 0)], 0)
            run = np.where((prev < 0) | (last_other[np.maximum(prev, 0)] < 0), run + run_carry, run)
            real = quotes[run % 2 == 0]
            toggles = np.zeros(n, dtype=np.int32)
            toggles[real] = 1
            parity = (np.cumsum(toggles) + in_string) % 2
            outside = (parity == 0) & (toggles == 0)
            delta = (outside & ((a == 91) | (a == 123))).astype(np.int64) - (outside & ((a == 93) | (a == 125)))
            after = depth + np.cumsum(delta)
            before = after - delta
            starts = np.flatnonzero((before == 0) & (after == 1) & (a == 91))
            ends = np.flatnonzero((before == 1) & (after == 0) & (a == 93))
            commas = np.flatnonzero(outside & (a == 44) & (after == 1))
            if not opened and len(starts):
                opened = True
            if len(ends):
                closed = True
            bounds.append(np.concatenate([starts, commas, ends]) + offset)
            in_string = int(parity[-1])
            depth = int(after[-1])
            tail = n - 1 - last_other[-1]
            run_carry = tail + run_carry if last_other[-1] < 0 else tail
            offset += n
    if not opened or not closed:
        raise DataError(f"{path} is not a JSON array (expected '[ {{...}}, {{...}} ]'); use JSON lines or an array.")
    b = np.sort(np.concatenate(bounds))
    spans = np.stack([b[:-1] + 1, b[1:]], axis=1).astype(np.int64)
    if len(spans) == 1:  # "[]" has no element
        with open(path, "rb") as f:
            f.seek(int(spans[0, 0]))
            if not f.read(int(spans[0, 1] - spans[0, 0])).strip():
                spans = spans[:0]
    return spans


class JsonArrayFile(JsonlFile):
    """Records of a JSON file holding one array of objects (LLaVA's layout)."""

    def __init__(self, path: Path) -> None:
        self.path, self.spans, self._file = path, _cached_index(path, "jsonarray", json_array_spans), _Handle(path)

    def where(self, i: int) -> int:
        """The element's 0-based index."""
        return int(i)


# ------------------------------------------------------------------------------------------------------------ Parquet
def _arrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("reading Parquet needs pyarrow: pip install pyarrow (or kimi-vl[eval]).") from exc
    return pa, pq


class ParquetFile:
    """Rows of a Parquet file, through an Arrow IPC copy in the cache (written once, row group by row group, then
    memory-mapped: any row is a cheap slice)."""

    format_hint = None

    def __init__(self, path: Path) -> None:
        pa, pq = _arrow()
        self.path = path
        self.ipc = _cache_path(path, "parquet", ".arrow")
        if not self.ipc.is_file():
            self.ipc.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.ipc.with_name(f"{self.ipc.name}.tmp-{os.getpid()}")
            try:
                source = pq.ParquetFile(path)
                with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, source.schema_arrow) as writer:
                    for batch in source.iter_batches(batch_size=16384):
                        writer.write_batch(batch)
            except (OSError, pa.ArrowException) as exc:
                tmp.unlink(missing_ok=True)
                raise DataError(f"{path} cannot be read as Parquet ({exc}).") from exc
            os.replace(tmp, self.ipc)
        self._reader, self._pid = None, None
        reader = self._open()
        sizes = [reader.get_batch(k).num_rows for k in range(reader.num_record_batches)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _open(self):
        if self._reader is None or self._pid != os.getpid():
            pa, _ = _arrow()
            self._reader, self._pid = pa.ipc.open_file(pa.memory_map(str(self.ipc))), os.getpid()
        return self._reader

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_pid": None}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, i: int) -> Any:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self._open().get_batch(k).slice(i - int(self.offsets[k]), 1).to_pylist()[0]

    def where(self, i: int) -> int:
        return int(i)


# ------------------------------------------------------------------------------------------------------- WebDataset
def _split_member(name: str) -> tuple[str, str]:
    folder, base = os.path.split(name)
    key, _, ext = base.partition(".")
    return os.path.join(folder, key), ext.lower()


def tar_index(path: Path) -> np.ndarray:
    """`[n, 2]` int64: the header offset of each sample's first member and its member count (members sharing a key
    are adjacent, as WebDataset writes them)."""
    out: list[tuple[int, int]] = []
    key = None
    try:
        with tarfile.open(path, mode="r:") as tar:
            while (m := tar.next()) is not None:
                tar.members = []  # keep memory flat on huge shards
                if not m.isfile():
                    continue
                k, _ = _split_member(m.name)
                if k == key:
                    out[-1] = (out[-1][0], out[-1][1] + 1)
                else:
                    out.append((m.offset, 1))
                    key = k
    except tarfile.TarError as exc:
        raise DataError(f"{path} cannot be read as an uncompressed tar shard ({exc}); WebDataset shards must be "
                        "plain .tar files (random access).") from exc
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


class TarShard:
    """Samples of a WebDataset tar shard: `{"__key__": key, ext: bytes, ...}` per key."""

    format_hint = "webdataset"

    def __init__(self, path: Path) -> None:
        self.path, self.index, self._file = path, _cached_index(path, "tar", tar_index), _Handle(path)

    def __len__(self) -> int:
        return len(self.index)

    def _members(self, i: int, count: int) -> Iterator[tuple[tarfile.TarInfo, Any]]:
        """The first `count` file members of sample `i` (headers read with `TarInfo.fromtarfile`)."""
        f = self._file.get()
        f.seek(0)
        tar = tarfile.open(fileobj=f, mode="r:")
        position, seen = int(self.index[i, 0]), 0
        while seen < count:
            f.seek(position)
            try:
                info = tarfile.TarInfo.fromtarfile(tar)
            except tarfile.HeaderError as exc:
                raise BadRecordError(f"the shard ends inside this sample (truncated tar: {exc})") from exc
            position = tar.offset
            if info.isfile():
                seen += 1
                yield info, f

    def read(self, i: int) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for info, f in self._members(i, int(self.index[i, 1])):
            key, ext = _split_member(info.name)
            f.seek(info.offset_data)
            row["__key__"], row[ext] = key, f.read(info.size)
        if "txt" in row:
            row["txt"] = row["txt"].decode("utf-8", "replace")
        return row

    def where(self, i: int) -> str:
        info, _ = next(self._members(i, 1))
        return _split_member(info.name)[0]


# --------------------------------------------------------------------------------------------------------- text files
class TextFile:
    """A `.txt` file: one document (UTF-8; a leading byte order mark is not part of the text)."""

    format_hint = "plain"

    def __init__(self, path: Path) -> None:
        self.path = path

    def __len__(self) -> int:
        return 1

    def read(self, i: int) -> dict[str, str]:
        try:
            return {"text": self.path.read_text(encoding="utf-8-sig")}
        except UnicodeDecodeError as exc:
            raise BadRecordError(f"not UTF-8 text ({exc})") from exc

    def where(self, i: int) -> int:
        return 1


# ----------------------------------------------------------------------------------------------- Hugging Face datasets
def parse_hub_name(spec: str) -> tuple[str, str | None, str]:
    """`hf:ORG/NAME[:CONFIG][@SPLIT]` -> `(ORG/NAME, CONFIG or None, SPLIT, default "train")`."""
    body = spec[3:]
    body, _, split = body.partition("@")
    name, _, config = body.partition(":")
    if not name:
        raise ConfigError(f"{spec!r} names no dataset; write hf:ORG/NAME[:CONFIG][@SPLIT].")
    return name, config or None, split or "train"


def _load_dataset(spec: str, streaming: bool) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("hf: data sources need the datasets package: pip install datasets") from exc
    name, config, split = parse_hub_name(spec)
    from ..eval import data as hub  # the eval data's hub probe (imported here: kimi_vl.eval imports this package)

    if not hub.hub_offline() and not hub.hub_reachable():
        raise DataError(f"{spec}: the Hugging Face hub is not reachable from this machine (no connection to "
                        f"{os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'} within "
                        f"{hub.HUB_PROBE_TIMEOUT_S:g} s); set HF_HUB_OFFLINE=1 to load it from the local cache "
                        "(HF_HOME), or pass a downloaded copy (a folder of its Parquet files).")
    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as exc:  # the hub, the cache and the loading scripts raise many kinds
        raise DataError(f"{spec}: the dataset cannot be loaded ({type(exc).__name__}: {exc}); check the name, the "
                        "config and the split, and that the hub (or HF_HOME's cache) is reachable.") from exc


class HubDataset:
    """Rows of a Hugging Face dataset (Arrow, memory-mapped; media columns as `{"bytes", "path"}` structs)."""

    format_hint = None

    def __init__(self, spec: str) -> None:
        self.path = spec
        self.dataset = _load_dataset(spec, streaming=False).with_format("arrow")

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, i: int) -> dict[str, Any]:
        return self.dataset[int(i)].to_pylist()[0]

    def where(self, i: int) -> int:
        return int(i)


class StreamingHubDataset:
    """Rows of a streamed Hugging Face dataset, read in order (see the module docstring); its length is unknown,
    `len()` is a large bound and the stream restarts when it runs out: position `i` is then row `i mod rows` (`rows`
    learnt when it ran out), so later epochs read on in order as the first does."""

    format_hint = None
    UNKNOWN_LENGTH = 1 << 62
    RECENT_ROWS = 64
    """Rows kept after they are read: a batch that starts a few positions before the previous one ended (batches
    overlap at their edges, `kimi_vl.data.mixture`) reads them again without restarting the stream."""

    def __init__(self, spec: str) -> None:
        self.path, self.spec = spec, spec
        self._iter, self._pos, self._pid, self._rows = None, 0, None, None
        self._recent: deque = deque(maxlen=self.RECENT_ROWS)

    def __getstate__(self) -> dict:
        return {"path": self.path, "spec": self.spec, "_iter": None, "_pos": 0, "_pid": None, "_rows": self._rows,
                "_recent": deque(maxlen=self.RECENT_ROWS)}

    def __len__(self) -> int:
        return self.UNKNOWN_LENGTH

    def _restart(self) -> None:
        # not `iter(dataset)`: in a DataLoader worker that reads only the worker's share of the dataset's shards
        # (datasets splits them between workers), so position `i` would be another row there than here
        rows = _load_dataset(self.spec, streaming=True).iter(batch_size=1)
        self._iter = ({k: v[0] for k, v in batch.items()} for batch in rows)
        self._pos, self._pid = 0, os.getpid()
        self._recent.clear()

    def read(self, i: int) -> dict[str, Any]:
        if self._rows is not None:
            i %= self._rows
        if self._iter is None or self._pid != os.getpid() or i < self._pos - len(self._recent):
            self._restart()
        row = self._recent[i - self._pos] if i < self._pos else None
        while self._pos <= i:
            try:
                row = next(self._iter)
            except StopIteration:
                if self._pos == 0:
                    raise DataError(f"{self.spec}: the stream has no rows.") from None
                self._rows = self._pos  # the stream ran out: continue from its start (another epoch)
                i %= self._rows
                self._restart()
                continue
            self._pos += 1
            self._recent.append(row)
        return {k: (_image_struct(v) if hasattr(v, "save") else v) for k, v in row.items()}

    def where(self, i: int) -> int:
        return int(i)


def _image_struct(image: Any) -> dict[str, Any]:
    """A decoded PIL image (streamed datasets decode them) as the `{"bytes", "path"}` struct."""
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


# -------------------------------------------------------------------------------------------------------------- source
def open_file(path: Path) -> Any:
    """The reader of one data file, chosen by its suffix (`.json`: JSONL unless it starts with `[`, after any UTF-8
    byte order mark)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonlFile(path)
    if suffix == ".json":
        with open(path, "rb") as f:
            head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        return JsonArrayFile(path) if head.startswith(b"[") else JsonlFile(path)
    if suffix == ".parquet":
        return ParquetFile(path)
    if suffix == ".tar":
        return TarShard(path)
    if suffix == ".txt":
        return TextFile(path)
    raise DataError(f"{path}: unsupported data file type {suffix!r}; use {', '.join(DATA_SUFFIXES)} or hf:NAME.")


def split_weight(spec: str) -> tuple[str, float | None]:
    """`SRC=WEIGHT` -> `(SRC, WEIGHT)`; `(SRC, None)` without a weight, or when `spec` is an existing path as it is
    (a Hive-style partition folder such as `data/split=0`: `data/split=0=2` weighs it 2)."""
    target, sep, weight = spec.rpartition("=")
    if sep and not os.path.exists(spec):
        try:
            value = float(weight)
        except ValueError:
            return spec, None
        if not 0 <= value < math.inf:
            raise ConfigError(f"{spec!r}: a sampling weight must be a finite number >= 0.")
        return target, value
    return spec, None


def data_files(target: str) -> list[Path]:
    """The data files a path, folder or glob names (sorted; folders and globs keep only `DATA_SUFFIXES`). An existing
    file or folder is taken as named, even when its name holds glob characters (`data [v2].json`). A folder, like a
    glob, skips hidden files and folders (names starting with `.`: `.ipynb_checkpoints/` copies, macOS `._*`
    files), as `datasets` does."""
    if os.path.isfile(target):
        return [Path(target)]
    if os.path.isdir(target):
        root = Path(target)
        found = sorted(p for p in root.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    elif any(c in target for c in "*?["):
        found = sorted(Path(p) for p in globlib.glob(target, recursive=True))
    else:
        raise DataError(f"data source {target!r} does not exist (a file, a folder, a glob, or hf:ORG/NAME).")
    files = [p for p in found if p.is_file() and p.suffix.lower() in DATA_SUFFIXES]
    if not files:
        raise DataError(f"data source {target!r} holds no data files ({', '.join(DATA_SUFFIXES)}).")
    return files


@dataclass
class Source:
    """One `--data` entry: its files (or dataset) as one sequence of records.

    Attributes:
        name: the entry as given, without its weight.
        weight: its sampling weight (None: proportional to its record count).
        readers: the file readers, in order.
        media_root: the folder relative media paths are read from (None: each file's own folder).
    """

    name: str
    weight: float | None
    readers: list[Any]
    media_root: Path | None = None

    def __post_init__(self) -> None:
        self.offsets = np.concatenate([[0], np.cumsum([len(r) for r in self.readers])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def streaming(self) -> bool:
        return any(isinstance(r, StreamingHubDataset) for r in self.readers)

    def locate(self, i: int) -> tuple[Any, int]:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.readers[k], int(i - self.offsets[k])

    def read(self, i: int) -> tuple[Any, Any, Path | None]:
        """`(row, reader, media base folder)` of record `i` (`BadRecordError` without its location)."""
        reader, j = self.locate(i)
        base = self.media_root or (reader.path.parent if isinstance(reader.path, Path) else None)
        return reader.read(j), reader, base

    def where(self, i: int) -> tuple[str, Any]:
        reader, j = self.locate(i)
        return str(reader.path), reader.where(j)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data: each file's path, size and a hash of its first and last MiB (not its
        modification time, so a copied folder still matches), or the dataset's name."""
        files = []
        for r in self.readers:
            if isinstance(r.path, Path):
                files.append({"path": str(r.path), **file_fingerprint(r.path)})
            else:
                files.append({"path": r.path, "rows": None if isinstance(r, StreamingHubDataset) else len(r)})
        return {"name": self.name, "weight": self.weight, "files": files,
                "media_root": None if self.media_root is None else str(self.media_root)}


def file_fingerprint(path: Path) -> dict[str, Any]:
    """`{"size", "sha1_ends"}`: a file's size and a SHA-1 of its first and last MiB, which identify its content
    cheaply (not its modification time: a copy matches)."""
    size = path.stat().st_size
    h = hashlib.sha1()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return {"size": size, "sha1_ends": h.hexdigest()}


def open_source(spec: str, *, media_root: str | os.PathLike | None = None, streaming: bool = False) -> Source:
    """The `Source` of one `--data` entry (`SRC[=WEIGHT]`)."""
    target, weight = split_weight(spec)
    root = None if media_root is None else Path(media_root)
    if target.startswith("hf:"):
        reader = StreamingHubDataset(target) if streaming else HubDataset(target)
        return Source(target, weight, [reader], root)
    readers = [open_file(p) for p in data_files(target)]
    return Source(target, weight, readers, root)


__all__ = ["DATA_SUFFIXES", "HubDataset", "JsonArrayFile", "JsonlFile", "ParquetFile", "Source",
           "StreamingHubDataset", "TarShard", "TextFile", "cache_dir", "data_files", "file_fingerprint",
           "json_array_spans", "jsonl_spans", "open_file", "open_source", "parse_hub_name", "split_weight", "tar_index"]
