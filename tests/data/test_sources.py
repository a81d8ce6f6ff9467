"""Random-access readers of users' files (`kimi_vl.data.sources`): indexes against the formats' own parsers, cached
indexes, tar shards, Hugging Face datasets (local, through a stand-in `load_dataset`), `SRC=WEIGHT` and folders."""

import json
import random

import numpy as np
import pytest

from kimi_vl.data import sources
from kimi_vl.data.sources import (
    JsonArrayFile,
    JsonlFile,
    ParquetFile,
    TarShard,
    data_files,
    json_array_spans,
    open_file,
    open_source,
    parse_hub_name,
    split_weight,
)
from kimi_vl.errors import BadRecordError, ConfigError, DataError
from tests.data.userdata import write_user_data


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    return write_user_data(tmp_path_factory.mktemp("userdata"))


def test_jsonl_skips_blank_lines_and_reports_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2}\r\n{bad\n{"a": 3}')  # no final newline
    f = JsonlFile(path)
    assert len(f) == 4
    assert [f.read(i) for i in (0, 1, 3)] == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert [f.where(i) for i in range(4)] == [1, 4, 5, 6]
    with pytest.raises(BadRecordError, match="malformed JSON"):
        f.read(2)


def _adversarial_rows(n: int, seed: int) -> list:
    rng = random.Random(seed)
    pieces = ['\\', '"', ',', '[', ']', '{', '}', '\\\\', '\\"', 'é', '\n', 'x' * 50]
    return [{"text": "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))),
             "nested": [[rng.random(), {"k": "]"}]] if i % 3 else {}} for i in range(n)]


@pytest.mark.parametrize("block", [7, 64, 1 << 20])
def test_json_array_scan_matches_json_load(tmp_path, monkeypatch, block):
    """Strings full of quotes, backslashes, commas and brackets, cut by block boundaries anywhere: the scan finds
    exactly the elements `json.load` sees."""
    monkeypatch.setattr(sources, "BLOCK", block * 4)  # the scan reads BLOCK // 4 bytes at a time
    rows = _adversarial_rows(60, block)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2 if block == 64 else None))
    spans = json_array_spans(path)
    data = path.read_bytes()
    assert [json.loads(data[a:b]) for a, b in spans[:, :2]] == rows
    f = JsonArrayFile(path)
    assert len(f) == 60 and f.read(17) == rows[17] and f.where(17) == 17


def test_json_array_edge_cases(tmp_path):
    (tmp_path / "empty.json").write_text(" [ ] ")
    assert len(open_file(tmp_path / "empty.json")) == 0
    (tmp_path / "obj.json").write_text('{"a": 1}\n{"a": 2}\n')  # .json holding JSON lines
    assert isinstance(open_file(tmp_path / "obj.json"), JsonlFile) and len(open_file(tmp_path / "obj.json")) == 2
    (tmp_path / "open.json").write_text('[{"a": 1}, {"a": 2}')
    with pytest.raises(DataError, match="not a JSON array"):
        json_array_spans(tmp_path / "open.json")


def test_indexes_are_cached_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    assert len(JsonlFile(path)) == 2
    calls = []
    monkeypatch.setattr(sources, "jsonl_spans", lambda p: calls.append(p) or np.zeros((0, 3), np.int64))
    assert len(JsonlFile(path)) == 2 and not calls  # read from the cache
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    JsonlFile(path)
    assert calls == [path]  # size changed: rebuilt


def test_parquet_rows_round_trip(user_data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}], "extra": {"x": [i, i + 1]}}
            for i in range(50)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet", row_group_size=7)
    f = ParquetFile(tmp_path / "r.parquet")
    assert len(f) == 50 and [f.read(i) for i in (0, 6, 7, 49)] == [rows[i] for i in (0, 6, 7, 49)]
    verl = ParquetFile(user_data["verl.parquet"])
    assert verl.read(0)["reward_model"]["ground_truth"] == "1" and isinstance(verl.read(0)["images"][0]["bytes"],
                                                                            bytes)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(DataError, match="cannot be read as Parquet"):
        ParquetFile(tmp_path / "broken.parquet")


def test_tar_shards_group_members_by_key(user_data, tmp_path):
    shard = TarShard(user_data["shards"] / "part-00001.tar")
    assert len(shard) == 3
    row = shard.read(1)
    assert row["__key__"] == "sample11" and set(row) == {"__key__", "png", "json"}
    assert json.loads(row["json"])["caption"] == "json caption 11" and shard.where(2) == "sample12"
    (tmp_path / "x.tar").write_bytes(b"\x1f\x8b not a plain tar")
    with pytest.raises(DataError, match="uncompressed tar"):
        TarShard(tmp_path / "x.tar")


def test_sources_weights_folders_and_globs(user_data, tmp_path):
    assert split_weight("data/a.jsonl=2.5") == ("data/a.jsonl", 2.5)
    assert split_weight("hf:org/name:cfg@train") == ("hf:org/name:cfg@train", None)
    assert split_weight("a=b.jsonl") == ("a=b.jsonl", None)
    for bad in ("-1", "inf", "1e400", "nan"):  # an infinite weight would make every draw probability NaN
        with pytest.raises(ConfigError, match="finite number >= 0"):
            split_weight(f"a.jsonl={bad}")
    root = user_data["docs.jsonl"].parent
    assert [p.name for p in data_files(str(root / "shards"))] == ["part-00000.tar", "part-00001.tar"]
    assert [p.name for p in data_files(str(root / "*.parquet"))] == ["obelics.parquet", "verl.parquet"]
    with pytest.raises(DataError, match="does not exist"):
        data_files(str(tmp_path / "nothing"))
    (tmp_path / "only-images").mkdir()
    (tmp_path / "only-images" / "a.png").write_bytes(b"")
    with pytest.raises(DataError, match="holds no data files"):
        data_files(str(tmp_path / "only-images"))
    src = open_source(f"{root / 'shards'}=3")
    assert src.weight == 3.0 and len(src) == 6 and src.read(4)[0]["__key__"] == "sample11"
    assert src.where(4) == (str(root / "shards" / "part-00001.tar"), "sample11")


def test_a_folder_skips_hidden_files_as_a_glob_does(tmp_path):
    # a notebook's checkpoint copy (the data twice) and a macOS resource fork (binary) are no data of the folder
    root = tmp_path / ".data"  # the folder itself may be hidden: only names under it count
    (root / ".ipynb_checkpoints").mkdir(parents=True)
    (root / "sub").mkdir()
    for path in (root / "train.jsonl", root / "sub" / "more.jsonl", root / ".ipynb_checkpoints" / "train.jsonl"):
        path.write_text('{"text": "a"}\n')
    (root / "._train.jsonl").write_bytes(b"\x00\x05\x16\x07\x00\x02")
    expected = [root / "sub" / "more.jsonl", root / "train.jsonl"]
    assert data_files(str(root)) == expected
    assert data_files(str(root / "**" / "*.jsonl")) == expected
    assert len(open_source(str(root))) == 2


def test_files_with_a_byte_order_mark_are_read_without_it(user_data, tmp_path):
    """A LLaVA JSON array saved with a UTF-8 byte order mark (Windows editors, PowerShell) is read as an array, not
    as JSON lines that are each malformed."""
    bom = tmp_path / "llava.json"
    bom.write_text(user_data["llava.json"].read_text(), encoding="utf-8-sig")
    src = open_source(str(bom))
    assert len(src) == 9 and src.read(8)[0]["id"] == "text-only" and src.where(8) == (str(bom), 8)
    note = tmp_path / "note.txt"  # and a .txt file's text does not start with U+FEFF
    note.write_text("Plain words.", encoding="utf-8-sig")
    assert open_source(str(note)).read(0)[0] == {"text": "Plain words."}


def test_paths_named_like_weights_or_globs_are_read_as_named(user_data, tmp_path):
    """A Hive-style partition folder (`split=0`) is a path, not a source weighted 0, and a file whose name holds glob
    characters (`llava [v2].json`) is that file, not a glob matching nothing."""
    hive = tmp_path / "data" / "split=0"
    hive.mkdir(parents=True)
    (hive / "a.jsonl").write_text(user_data["sharegpt.jsonl"].read_text())
    assert split_weight(str(hive)) == (str(hive), None)
    assert split_weight(f"{hive}=2") == (str(hive), 2.0)
    src = open_source(str(hive))
    assert src.weight is None and len(src) == 1
    odd = tmp_path / "llava [v2].json"
    odd.write_text(user_data["llava.json"].read_text())
    assert data_files(str(odd)) == [odd] and len(open_source(f"{odd}=3")) == 9
    assert data_files(str(tmp_path / "*.json")) == [odd]  # a glob is still a glob


def test_fingerprint_ignores_mtime_but_sees_content(tmp_path):
    import os

    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n')
    before = open_source(str(path)).fingerprint()
    os.utime(path, (1, 1))
    assert open_source(str(path)).fingerprint() == before
    path.write_text('{"text": "b"}\n')
    assert open_source(str(path)).fingerprint() != before


def _fake_hub(monkeypatch, make) -> list:
    """`datasets.load_dataset` replaced by `make(name, config, split, streaming)` (tests never download) and the hub
    reachable; returns the list of `(name, config, split, streaming)` calls, filled as they come."""
    import datasets

    calls = []

    def fake_load(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return make(name, config, split, streaming)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr("kimi_vl.eval.data.hub_reachable", lambda timeout=3.0: True)
    return calls


def _streamed_rows(n: int, num_shards: int = 1):
    """A `make` for `_fake_hub`: `n` rows `{"text": "t<i>"}` as an iterable dataset of `num_shards` shards."""
    import datasets

    return lambda *args: datasets.Dataset.from_list([{"text": f"t{i}"} for i in range(n)]).to_iterable_dataset(
        num_shards=num_shards)


def test_hub_datasets_by_name(monkeypatch):
    """`hf:` sources go through `datasets.load_dataset` (a local stand-in here: tests never download); image
    columns come back as `{"bytes", "path"}` structs, not decoded."""
    import datasets

    from tests.data.userdata import image, png_bytes

    def make(name, config, split, streaming):
        features = datasets.Features({"text": datasets.Value("string"), "image": datasets.Image()})
        ds = datasets.Dataset.from_list([{"text": f"t{i}", "image": {"bytes": png_bytes(image(i)), "path": None}}
                                         for i in range(4)], features=features)
        return ds.to_iterable_dataset() if streaming else ds

    calls = _fake_hub(monkeypatch, make)
    assert parse_hub_name("hf:org/name:cfg@validation") == ("org/name", "cfg", "validation")
    src = open_source("hf:org/name:cfg@validation")
    row, _, base = src.read(2)
    assert len(src) == 4 and row["text"] == "t2" and isinstance(row["image"]["bytes"], bytes) and base is None
    assert calls == [("org/name", "cfg", "validation", False)]
    stream = open_source("hf:org/name", streaming=True)  # read in order, lazily
    assert stream.streaming and len(calls) == 1
    assert [stream.read(i)[0]["text"] for i in (0, 1, 3, 1, 5)] == ["t0", "t1", "t3", "t1", "t1"]  # 5 wraps to 1
    assert calls[-1] == ("org/name", None, "train", True) and len(calls) == 3  # a wrap restarts, a step back not
    with pytest.raises(ConfigError, match="names no dataset"):
        parse_hub_name("hf:")


def test_a_streamed_dataset_reads_later_epochs_in_order(monkeypatch):
    """Once a stream has run out, its next epochs are read on in order like the first: one pass per epoch, not a
    pass of the whole stream for every row."""
    passes = _fake_hub(monkeypatch, _streamed_rows(100))
    stream = open_source("hf:org/name", streaming=True)
    assert [stream.read(i)[0]["text"] for i in range(300)] == [f"t{i}" for i in range(100)] * 3
    assert len(passes) == 3


def test_a_streamed_dataset_steps_back_over_a_batch_edge_without_restarting(monkeypatch):
    """Consecutive batches overlap by a few positions at their edges: each such step back restarted the stream and
    read it again from its first row (at a long run's position, the whole stream so far, once every few batches).
    The last `RECENT_ROWS` rows are kept; a step back further restarts it."""
    passes = _fake_hub(monkeypatch, _streamed_rows(200))
    stream = open_source("hf:org/name", streaming=True)
    back = sources.StreamingHubDataset.RECENT_ROWS
    positions = [*range(0, 30), *range(27, 60), 100, 100 - back + 1, 101, 100 - back]
    assert [stream.read(i)[0]["text"] for i in positions] == [f"t{i}" for i in positions]
    assert len(passes) == 2  # the last position alone is further back than the rows kept


def test_a_streamed_dataset_gives_data_loader_workers_the_same_rows(monkeypatch):
    """In a DataLoader worker, iterating a streamed dataset reads only that worker's share of its shards (datasets
    splits them between workers): position 1 was row 11 in the second of two workers, and a worker without a shard
    stopped with "the stream has no rows". Every worker reads every shard, in the order the training process does."""
    from kimi_vl.data.loader import batches

    shards = [4]
    _fake_hub(monkeypatch, lambda *args: _streamed_rows(40, shards[0])())

    class Rows:
        def __init__(self) -> None:
            self.source = open_source("hf:org/name", streaming=True)

        def batch(self, i: int) -> str:
            return self.source.read(i)[0]["text"]

    for workers, shards[0] in ((2, 4), (2, 1)):
        assert list(batches(Rows(), range(6), workers)) == [f"t{i}" for i in range(6)]


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    """Offline, an `hf:` source is a clear `DataError` after the eval data's short hub probe, not after `datasets`'
    retries (about 30 s); with HF_HUB_OFFLINE set the probe is skipped and `datasets` reads its local cache."""
    import datasets

    calls, probes = [], []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or [{"text": "t"}])
    monkeypatch.setattr("kimi_vl.eval.data.hub_reachable", lambda timeout=3.0: probes.append(timeout) or False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DataError, match=r"hf:org/name: the Hugging Face hub is not reachable .* within 3 s\); set "
                                        "HF_HUB_OFFLINE=1"):
        open_source("hf:org/name")
    assert probes and not calls
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sources._load_dataset("hf:org/name", streaming=False)
    assert len(calls) == 1 and len(probes) == 1
