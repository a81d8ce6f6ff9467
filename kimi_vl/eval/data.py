"""Benchmark data: the Hugging Face datasets when reachable, local files otherwise.

Local files (`--data-dir DIR`) use the datasets' own schemas. For a benchmark `name` the files are looked up under
`DIR/<name>/` first (e.g. `DIR/mmlu_pro/`, `DIR/mathvista/`), then under `DIR` itself, recursively; a split's
files are those whose name starts with the split name (`test-00000-of-00001.parquet`, `validation.jsonl`,
`testmini.json`, ...), in sorted order. Accepted formats:

- `.parquet` (what `huggingface-cli download --repo-type dataset` gives),
- `.jsonl` (one row per line),
- `.json`: a list of rows, or a dict of rows keyed by id (MathVista's `data/testmini.json`),
- a folder named after the split holding `state.json` and Arrow files (what `datasets`' `save_to_disk` writes for
  each split of a `DatasetDict`, e.g. `DIR/mmlu_pro/test/`), read with `datasets.load_from_disk`.

Hub access fails fast: with `HF_HUB_OFFLINE` / `HF_DATASETS_OFFLINE` set only the local cache is tried, and
otherwise the hub endpoint is probed with a short socket timeout before `datasets.load_dataset` is called, so an
offline machine gets a `DataUnavailableError` saying to pass `--data-dir` within seconds instead of a hang.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import getproxies, proxy_bypass

from ..errors import BadRecordError, DataUnavailableError

HUB_PROBE_TIMEOUT_S = 3.0
"""Seconds the hub probe waits for a TCP connection before declaring the hub unreachable."""

DATA_EXTENSIONS = (".parquet", ".jsonl", ".json")

RowCheck = Callable[[Mapping[str, Any]], "str | None"]
"""A row check: what is wrong with a row (a sentence), or None when it can be used."""


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when the environment asks for offline mode (`HF_HUB_OFFLINE` or `HF_DATASETS_OFFLINE`)."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint (`HF_ENDPOINT`, default huggingface.co:443), or to the HTTP(S)
    proxy configured for it in the environment, opens within `timeout` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    proxy = getproxies().get(url.scheme or "https")
    if proxy and not proxy_bypass(host):
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        host = url.hostname or host
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def load_hub_dataset(repo: str, split: str | None, *, hint: str) -> Any:
    """`datasets.load_dataset(repo, split=split)`, failing fast and clearly when the hub cannot be used.

    Args:
        repo: dataset repository id, e.g. `"TIGER-Lab/MMLU-Pro"`.
        split: split name, or None for the whole `DatasetDict`.
        hint: what to do instead (appended to the error), e.g. how to lay out `--data-dir`.

    Raises:
        DataUnavailableError: `datasets` missing, hub unreachable (and nothing cached), or loading failed.
    """
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dev / eval dependency
        raise DataUnavailableError(
            f"loading {repo} from the hub needs the `datasets` package (pip install 'kimi-vl[eval]'); {hint}"
        ) from exc
    if not hub_offline() and not hub_reachable():
        raise DataUnavailableError(
            f"the Hugging Face hub is not reachable from this machine (no connection to "
            f"{os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'} within {HUB_PROBE_TIMEOUT_S:g} s), so "
            f"{repo} cannot be downloaded; {hint}"
        )
    try:
        return datasets.load_dataset(repo, split=split)
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError...)
        offline = " (offline mode is on and the dataset is not in the local cache)" if hub_offline() else ""
        raise DataUnavailableError(f"could not load {repo}{offline}: {exc}; {hint}") from exc


def _read_file(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """`(number, row)` of each row of one parquet / JSONL / JSON file (a dict of rows keyed by id gives its values, in
    order) or `save_to_disk` split folder; `number` is the line of a JSONL row, else the row's position, counted
    from 1."""
    try:
        if path.is_dir():
            import datasets

            return list(enumerate(datasets.load_from_disk(str(path)), 1))
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(enumerate(pq.read_table(path).to_pylist(), 1))
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                return [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        kind = "save_to_disk folder" if path.is_dir() else f"{path.suffix} file"
        raise DataUnavailableError(f"cannot read {path}: {exc}; check that it is a valid {kind}.") from exc
    if isinstance(data, dict):
        rows = list(data.values())
    elif isinstance(data, list):
        rows = data
    else:
        raise DataUnavailableError(f"{path} holds a JSON {type(data).__name__}; expected a list or a dict of rows.")
    if not all(isinstance(r, dict) for r in rows):
        raise DataUnavailableError(f"{path}: every row must be a JSON object.")
    return list(enumerate(rows, 1))


def check_rows(rows: Sequence[tuple[int, Mapping[str, Any]]], check: RowCheck, source: str, fix: str) -> None:
    """Apply `check` to every `(number, row)` of `source` (a file, or a hub dataset's split).

    Raises:
        BadRecordError (a DataError): the first row `check` finds wrong, as `SOURCE:NUMBER: what is wrong; fix`.
    """
    for number, row in rows:
        reason = check(row)
        if reason:
            raise BadRecordError(f"{reason}; {fix}", source, number)


def split_files(data_dir: str | os.PathLike, benchmark_dirs: Sequence[str], split: str) -> list[Path]:
    """Files of `split` under `data_dir` (see the module docstring for the search order)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataUnavailableError(f"--data-dir {root} is not a directory; pass the folder holding the data files.")
    for base in [root / name for name in benchmark_dirs] + [root]:
        if not base.is_dir():
            continue
        found = sorted(
            p for p in base.rglob(f"{split}*")
            if p.is_file() and p.suffix in DATA_EXTENSIONS or p.name == split and (p / "state.json").is_file()
        )
        if found:
            return found
    return []


def load_local_split(
    data_dir: str | os.PathLike, benchmark_dirs: Sequence[str], split: str, *, required: bool = True, hint: str = "",
    check: RowCheck | None = None, fix: str = "fix the row or remove it",
) -> tuple[list[dict[str, Any]], list[Path]]:
    """Rows of `split` read from the local files under `data_dir` and the files they came from; with `check`,
    every row is checked (`check_rows`, `fix` ending the message) as its file is read.

    Raises:
        DataUnavailableError: no file for the split (when `required`; `hint`, e.g. why the split is needed, ends
            the message), or an unreadable file.
        BadRecordError: a row `check` finds wrong (the message names the file and the row).
    """
    files = split_files(data_dir, benchmark_dirs, split)
    if not files:
        if not required:
            return [], []
        where = ", ".join(str(Path(data_dir) / d) for d in benchmark_dirs) + f" or {data_dir}"
        raise DataUnavailableError(
            f"no '{split}' data file under {where}: expected a file named {split}*.parquet, {split}*.jsonl or "
            f"{split}*.json, or a folder {split}/ written by datasets' save_to_disk (the dataset's own schema)."
            f"{' ' + hint if hint else ''}"
        )
    rows: list[dict[str, Any]] = []
    for path in files:
        numbered = _read_file(path)
        if check is not None:
            check_rows(numbered, check, str(path), fix)
        rows.extend(row for _, row in numbered)
    return rows, files


def require_rows(rows: Sequence[Any], split: str, source: str | Sequence[os.PathLike], fix: str) -> None:
    """Raise when a benchmark split has no rows at all (an empty file would otherwise score "0/0").

    Raises:
        DataUnavailableError: `no SPLIT rows in SOURCE; fix`.
    """
    if not rows:
        where = source if isinstance(source, str) else ", ".join(str(p) for p in source)
        raise DataUnavailableError(f"no {split} rows in {where}; {fix}")


__all__ = [
    "DataUnavailableError",
    "HUB_PROBE_TIMEOUT_S",
    "RowCheck",
    "check_rows",
    "hub_offline",
    "hub_reachable",
    "load_hub_dataset",
    "load_local_split",
    "require_rows",
    "split_files",
]
