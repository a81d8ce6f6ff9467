"""Mixing users' sources (`kimi_vl.data.mixture`): the shuffled read order, weights, epoch coverage, batches as pure
functions of their index, bad records replaced deterministically, strict mode, the vision ratio on users' data, RL
prompts, and data fingerprints."""

import json
import re
from collections import Counter

import pytest
import torch

from kimi_vl.data.mixture import (
    Mixture,
    PromptStream,
    Shuffle,
    fingerprint_changes,
    mixture_stream,
)
from kimi_vl.data.sources import open_source
from kimi_vl.errors import BadRecordError, ConfigError, DataError
from tests.data.userdata import image, write_user_data

SEQ, ROWS = 64, 2


def docs(path, n, *, tag="doc", bad=(), image_dir=None):
    with open(path, "w") as f:
        for i in range(n):
            if i in bad:
                f.write("{broken\n")
            elif image_dir is not None:
                f.write(json.dumps({"text": f"{tag}{i} <image> pictured", "images": [f"{image_dir}/{i % 4}.png"]}) + "\n")
            else:
                f.write(json.dumps({"text": f"{tag}{i} " + "words and more words " * 3}) + "\n")
    return str(path)


def mixture(*specs, kinds=("document", "chat"), **kw):
    return Mixture([open_source(s) for s in specs], seed=kw.pop("seed", 0), kinds=kinds, **kw)


def tags(proc, batch, tag="doc"):
    return re.findall(rf"\b{tag}(\d+) ", proc.tokenizer.decode(batch.input_ids[0]))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 257])
def test_shuffle_is_a_bijection(n):
    for key in ("a", "b"):
        out = [Shuffle(n, key)(i) for i in range(n)]
        assert sorted(out) == list(range(n))
    if n >= 7:
        assert [Shuffle(n, "a")(i) for i in range(n)] != [Shuffle(n, "b")(i) for i in range(n)]
        assert [Shuffle(n, "a")(i) for i in range(n)] != list(range(n))
    with pytest.raises(IndexError):
        Shuffle(n, "a")(n)


def test_weights_give_the_observed_proportions(proc, tmp_path):
    a, b = docs(tmp_path / "a.jsonl", 300, tag="a"), docs(tmp_path / "b.jsonl", 100, tag="b")
    for specs, expected in (((f"{a}=1", f"{b}=3"), 0.25), ((a, b), 0.75), ((f"{a}=2", b), 2 / 3)):
        m = mixture(*specs)
        stream = mixture_stream(m, proc, seq_len=SEQ, rows=ROWS, seed=0)
        drawn = Counter()
        for i in range(60):
            drawn.update(stream.batch(i).documents)
        assert drawn[a] / (drawn[a] + drawn[b]) == pytest.approx(expected, abs=0.06)


def test_an_epoch_reads_every_record_about_once(proc, tmp_path):
    source = docs(tmp_path / "a.jsonl", 80)
    m = mixture(source)
    stream = mixture_stream(m, proc, seq_len=SEQ, rows=ROWS, seed=0)
    rate = m.rates[source]
    assert 2 < rate < 10  # measured draws per batch
    seen = Counter()
    for i in range(round(80 / rate)):
        seen.update(tags(proc, stream.batch(i)))
    assert len(seen) >= 0.85 * 80 and max(seen.values()) <= 2
    other = mixture_stream(mixture(source, seed=1), proc, seq_len=SEQ, rows=ROWS, seed=1)
    assert tags(proc, other.batch(0)) != tags(proc, stream.batch(0))  # the order depends on the seed


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_epoch_of_several_sources_reads_every_record_about_once_over_the_ranks(proc, tmp_path, world):
    """Rank `r` of `world` builds its own stream and takes batches `r, r + world, ...`: over one epoch the ranks
    together read each record of every source about once. The draws of a batch pick sources at random; each source
    still reads its share of the batch (from `floor(i * rate)` to `floor((i + 1) * rate)`) rather than as many records
    as its random picks, which left up to a third of a source unread in an epoch and read others two or three times."""
    sizes = {"a": 60, "b": 40, "c": 30}
    specs = [docs(tmp_path / f"{t}.jsonl", n, tag=t) for t, n in sizes.items()]
    seen = {t: Counter() for t in sizes}
    for rank in range(world):
        m = mixture(*specs)
        stream = mixture_stream(m, proc, seq_len=SEQ, rows=ROWS, seed=0)
        for i in range(rank, round(sum(sizes.values()) / sum(m.rates.values())), world):
            batch = stream.batch(i)
            for t in sizes:
                seen[t].update(tags(proc, batch, t))
    assert sum(map(len, seen.values())) >= 0.88 * sum(sizes.values())
    for t, n in sizes.items():
        assert len(seen[t]) >= 0.85 * n and max(seen[t].values()) <= 2


def test_rl_prompts_of_several_sources_read_every_row_about_once_an_epoch(tmp_path):
    rows = {"p": 40, "q": 24, "r": 16}
    specs = []
    for t, n in rows.items():
        path = tmp_path / f"{t}.jsonl"
        path.write_text("".join(json.dumps({"problem": f"{t}{i}?", "answer": str(i)}) + "\n" for i in range(n)))
        specs.append(str(path))
    stream = PromptStream(mixture(*specs, kinds=("prompt",)), per_step=8)
    seen = Counter((p.source, p.answer) for step in range(10) for p in stream.prompts(step)[0])
    assert len(seen) >= 76 and max(seen.values()) <= 2  # 80 rows, 8 per step: before, 68 and 12 read twice


def test_batches_are_pure_functions_of_their_index(proc, tmp_path):
    src = docs(tmp_path / "a.jsonl", 50, bad=(3, 11, 12, 30))
    one = mixture_stream(mixture(src), proc, seq_len=SEQ, rows=ROWS, seed=5)
    two = mixture_stream(mixture(src), proc, seq_len=SEQ, rows=ROWS, seed=5)
    for i in (9, 0, 4):  # any order
        b1, b2 = one.batch(i), two.batch(i)
        assert torch.equal(b1.input_ids, b2.input_ids) and torch.equal(b1.labels, b2.labels)
        assert b1.documents == b2.documents and b1.bad_records == b2.bad_records


def test_bad_records_are_skipped_replaced_and_reported(proc, tmp_path):
    src = docs(tmp_path / "a.jsonl", 40, bad=set(range(0, 40, 3)))
    stream = mixture_stream(mixture(src), proc, seq_len=SEQ, rows=ROWS, seed=0)
    bad = [r for i in range(8) for r in stream.batch(i).bad_records]
    assert bad and all(r["source"] == src and r["file"] == src and r["reason"].startswith("malformed JSON")
                       for r in bad)
    assert {r["row"] for r in bad} <= {i + 1 for i in range(0, 40, 3)}  # 1-based line numbers of the bad lines
    assert all(stream.batch(i).num_pad_tokens == 0 for i in range(8))  # the replacements filled the rows

    with pytest.raises(BadRecordError, match=r"a\.jsonl:\d+: malformed JSON.*--strict") as err:
        mixture_stream(mixture(src, strict=True), proc, seq_len=SEQ, rows=ROWS, seed=0)
    assert err.value.file == src and err.value.row in {i + 1 for i in range(0, 40, 3)}

    all_bad = docs(tmp_path / "bad.jsonl", 10, bad=set(range(10)))
    with pytest.raises(DataError, match="more than 3 bad records in a row in data source .*bad.jsonl"):
        mixture_stream(mixture(all_bad, max_bad_in_a_row=3), proc, seq_len=SEQ, rows=ROWS, seed=0)


def test_stages_refuse_data_of_the_wrong_kind(tmp_path):
    data = write_user_data(tmp_path)
    with pytest.raises(ConfigError, match="holds documents, but this stage trains on chats"):
        mixture(str(data["docs.jsonl"]), kinds=("chat",))
    with pytest.raises(ConfigError, match="holds prompts"):
        mixture(str(data["verl.parquet"]))
    with pytest.raises(ConfigError, match="given twice"):
        mixture(str(data["docs.jsonl"]), str(data["docs.jsonl"]))


def test_vision_ratio_on_users_media_and_text_sources(proc, tmp_path):
    (tmp_path / "img").mkdir()
    for i in range(4):
        image(i, 112, 112).save(tmp_path / "img" / f"{i}.png")
    pictures = docs(tmp_path / "pictures.jsonl", 60, tag="pic", image_dir="img")
    text = docs(tmp_path / "text.jsonl", 60)
    m = mixture(pictures, text)
    assert [s.name for s in m.media_sources()] == [pictures]
    stream = mixture_stream(m, proc, seq_len=128, rows=4, seed=0, vision_ratio=0.3)
    shares = [stream.batch(i).num_vision_tokens / stream.batch(i).num_tokens for i in range(5)]
    assert all(abs(s - 0.3) < 0.08 for s in shares), shares
    b = stream.batch(0)
    assert int((b.input_ids == proc.image_token_id).sum()) == int(b.image_grid_thw.prod(-1).sum()) // 4
    alone = mixture_stream(mixture(text), proc, seq_len=128, rows=4, seed=0, vision_ratio=0.3)
    assert alone.batch(0).num_vision_tokens == 0  # no media source: no ratio to keep
    for off, on in ((pictures, text), (text, pictures)):  # a source weighted 0 is never drawn, not a group of its own
        batch = mixture_stream(mixture(f"{off}=0", on), proc, seq_len=128, rows=4, seed=0, vision_ratio=0.3).batch(0)
        assert off not in batch.documents and batch.documents[on] > 0


def test_an_image_block_longer_than_a_row_is_skipped_whatever_the_tokenizer(proc, tmp_path):
    """A tokenizer trained on users' text may split the block's `image` into several tokens: a block longer than a
    row by them is a bad record in the check and in training (skipped), not a `ConfigError` that stops the run."""
    from kimi_vl.data.check import check
    from kimi_vl.processing import KimiVLProcessor
    from kimi_vl.tokenization import build_tokenizer

    tok = build_tokenizer(["plain words, no media names"] * 20, 320)
    assert len(tok.tokenize("image")) >= 3  # the block: 16 placeholders + 2 special tokens + these > 20
    processor = KimiVLProcessor(proc.image_processor, tok, proc.video_processor)
    image(0, 112, 112).save(tmp_path / "big.png")  # 16 tokens: with 4 framing tokens it would fit a row of 20
    image(1, 28, 28).save(tmp_path / "small.png")  # 1 token
    path = tmp_path / "pictures.jsonl"
    path.write_text("".join(json.dumps({"text": f"pic{i} <image>", "images": ["big.png" if i == 0 else "small.png"]})
                            + "\n" for i in range(8)))
    [report] = check([str(path)], processor=processor, progress=False, seq_len=20)
    assert [row for _, row, _ in report.bad] == [1] and report.records == 7
    stream = mixture_stream(mixture(str(path)), processor, seq_len=20, rows=2, seed=0)
    bad = [r for i in range(6) for r in stream.batch(i).bad_records]
    assert bad and {r["row"] for r in bad} == {1} and "an image of 16 vision tokens" in bad[0]["reason"]


def test_rl_prompts_from_users_rows(tmp_path):
    data = write_user_data(tmp_path)
    m = Mixture([open_source(f"{data['verl.parquet']}=3"), open_source(f"{data['easyr1.jsonl']}=1")], seed=0,
                kinds=("prompt",))
    stream = PromptStream(m, per_step=6)
    prompts, bad = stream.prompts(2)
    again, bad_again = PromptStream(m, per_step=6).prompts(2)
    assert len(prompts) == 6 and [p.answer for p in prompts] == [p.answer for p in again] and bad == bad_again
    assert {p.task for p in prompts} <= {"hiyouga/geometry3k", "easyr1"}
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    verl = next(p for p in prompts if p.task == "hiyouga/geometry3k")
    assert verl.reward == "number" and verl.messages[0]["content"][0]["image"].mode == "RGB"
    reasons = {r["reason"] for step in range(10) for r in stream.prompts(step)[1]}
    missing = "no RL answer (the ground truth is missing, empty or NaN: a Parquet float column's missing value)"
    assert all(r == missing or re.fullmatch(r"image file '.*/img/gone\.png( \([\d,]+ characters\))?' does not exist; "
                                            r"check the path\.", r) for r in reasons), reasons


def test_tokenizer_texts_and_fingerprints(tmp_path):
    data = write_user_data(tmp_path)
    m = mixture(str(data["docs.jsonl"]), str(data["llava.json"]))
    texts = m.texts(8)
    assert len(texts) == 8 and all(isinstance(t, str) and t for t in texts)
    old = m.fingerprint()
    assert fingerprint_changes(old, mixture(str(data["docs.jsonl"]), str(data["llava.json"])).fingerprint()) == []
    changed = mixture(f"{data['docs.jsonl']}=2", str(data["notes"])).fingerprint()
    lines = fingerprint_changes(old, changed)
    assert f"source {data['llava.json']} was removed" in lines and f"source {data['notes']} was added" in lines
    assert f"source {data['docs.jsonl']}: weight None -> 2.0" in lines
    with open(data["docs.jsonl"], "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    grown = mixture(str(data["docs.jsonl"]), str(data["llava.json"])).fingerprint()
    assert any("docs.jsonl: size" in line for line in fingerprint_changes(old, grown))
    old = mixture(str(data["docs.jsonl"]), str(data["llava.json"])).fingerprint()
    # draws pick sources by their order: another order is other data
    assert fingerprint_changes(old, mixture(str(data["llava.json"]), str(data["docs.jsonl"])).fingerprint()) == [
        f"the sources are in another order ({data['docs.jsonl']}, {data['llava.json']} before; draws pick sources "
        "by their order)"]
    # the same file under another path (a relative path given absolute, a moved folder) is named as such
    moved = tmp_path / "elsewhere" / "llava.json"
    moved.parent.mkdir()
    moved.write_bytes(data["llava.json"].read_bytes())
    assert fingerprint_changes(old, mixture(str(data["docs.jsonl"]), str(moved)).fingerprint()) == [
        f"source {data['llava.json']} is given as {moved}, the same files (each source's read order is keyed by the "
        f"path as given: give it as {data['llava.json']} to resume exactly)"]
    embedded = {"sources": [], "format": "auto", "reward": None, "seed": 0}
    assert "source embedded (standard library corpus + synthetic world) was removed" in fingerprint_changes(
        embedded, old)


def test_tokenizer_texts_come_from_the_other_sources_once_a_small_one_is_read(tmp_path):
    """An upweighted small source (3 records, weight 100) is read to its end at once; the tokenizer's texts then
    come from the other sources rather than stopping at a few dozen."""
    small, big = docs(tmp_path / "small.jsonl", 3, tag="s"), docs(tmp_path / "big.jsonl", 500, tag="b")
    texts = mixture(f"{small}=100", f"{big}=1").texts(200)
    assert len(texts) == 200
    assert sum(t.startswith("s") for t in texts) == 3 and len(set(texts)) == 200


def chats(path, n, *, long=(), words=400):
    with open(path, "w") as f:
        for i in range(n):
            question = "word " * words if i in long else f"question {i}?"
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": f"reply{i} ok"}]}) + "\n")
    return str(path)


def test_a_chat_longer_than_a_row_is_skipped_not_cut(proc, tmp_path, monkeypatch):
    """A chat is placed whole: one longer than a row would lose its reply to the cut, so it is a bad record (skipped,
    replaced, logged), every batch keeps its assistant replies, and a source of nothing else stops with an error."""
    src = chats(tmp_path / "chats.jsonl", 30, long={3, 11, 20})
    stream = mixture_stream(mixture(src, kinds=("chat",)), proc, seq_len=SEQ, rows=ROWS, seed=0)
    batches = [stream.batch(i) for i in range(12)]
    bad = [r for b in batches for r in b.bad_records]
    assert bad and {r["row"] for r in bad} <= {4, 12, 21}
    assert all(re.fullmatch(r"chat of [\d,]+ tokens does not fit a row of seq_len=64 \(a chat is packed whole\); "
                            r"raise --seq-len or shorten it", r["reason"]) for r in bad)
    assert all(b.num_loss_tokens > 0 for b in batches)
    text = "".join(proc.tokenizer.decode(b.input_ids[0]) for b in batches)
    assert "word word" not in text  # no piece of a long chat was packed

    import kimi_vl.data.mixture as mixture_module

    encoded = []
    real = mixture_module.encode_chat
    monkeypatch.setattr(mixture_module, "encode_chat", lambda *a: encoded.append(1) or real(*a))
    only_long = chats(tmp_path / "long.jsonl", 1, long={0})
    with pytest.raises(DataError, match=r"more than 5 bad records in a row .*long\.jsonl:1: chat of [\d,]+ tokens does "
                                        "not fit a row of seq_len=64"):
        mixture_stream(mixture(only_long, kinds=("chat",), max_bad_in_a_row=5), proc, seq_len=SEQ, rows=ROWS,
                       seed=0)
    assert len(encoded) == 1  # a record found bad is not encoded again when it is drawn again


def test_data_without_any_loss_token_is_an_error(proc, tmp_path, monkeypatch):
    """Data whose batches hold no token with a loss would skip every step with a NaN loss: it stops at start-up."""
    import kimi_vl.data.mixture as mixture_module

    real = mixture_module.encode_chat

    def no_loss(*args):
        doc = real(*args)
        doc.labels = [-100] * len(doc.labels)
        return doc

    src = chats(tmp_path / "chats.jsonl", 10)
    mixture_stream(mixture(src, kinds=("chat",)), proc, seq_len=SEQ, rows=ROWS, seed=0)  # fine as it is
    monkeypatch.setattr(mixture_module, "encode_chat", no_loss)
    with pytest.raises(DataError, match=r"no token of 4 batches of .*chats\.jsonl carries a loss"):
        mixture_stream(mixture(src, kinds=("chat",)), proc, seq_len=SEQ, rows=ROWS, seed=0)


def test_rl_prompts_whose_video_does_not_decode_are_bad_records(tmp_path, proc):
    """A video file is decoded only by the processor: the rollout's encoding of such a prompt stopped `kimi-vl train
    rl` ("cannot be decoded") where `data check` and the README call it a bad record, skipped and replaced."""
    (tmp_path / "bad.mp4").write_bytes(bytes(range(256)) * 20)
    rows = [{"problem": "<video>What color is it?", "answer": "red", "videos": ["bad.mp4"]},
            *({"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3))]
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stream = PromptStream(mixture(str(path), kinds=("prompt",)), per_step=4, processor=proc)
    prompts, bad = stream.prompts(0)
    assert len(prompts) == 4 and all(p.answer != "red" for p in prompts)
    # a set: the read order is keyed by the source's path (here a fresh temporary one), so the batch may wrap into
    # the next epoch and meet the bad record once more
    assert {(r["row"], "cannot be decoded" in r["reason"]) for r in bad} == {(1, True)}
