"""`kimi-vl data check` on a folder of users' files in every schema: exactly the bad rows, per-source counts, the
exit status, and exact token counts with a tokenizer."""

import re

import pytest

from kimi_vl.cli import main
from kimi_vl.data.check import check
from tests.data.userdata import BAD, write_user_data


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    return write_user_data(tmp_path_factory.mktemp("userdata"))


def test_check_reports_exactly_the_bad_rows(user_data, capsys, monkeypatch):
    root = user_data["docs.jsonl"].parent
    monkeypatch.chdir(root)
    names = ["docs.jsonl", "obelics.parquet", "shards", "notes", "llava.json", "messages.jsonl", "sharegpt.jsonl",
             "verl.parquet", "easyr1.jsonl"]
    assert main(["data", "check", *names, "--no-progress"]) == 1
    out = capsys.readouterr().out
    reported = {line.split(": ", 1)[0] for line in out.splitlines() if line and not line.startswith("|")
                and ":" in line.split(" ", 1)[0]}
    assert reported == set().union(*BAD.values())
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| source")}
    assert rows["docs.jsonl"][:5] == ["text (document) 7", "7", "3", "4", "2"]
    assert rows["shards"][:5] == ["webdataset (document) 6", "6", "0", "6", "0"]
    assert rows["llava.json"][:5] == ["sharegpt (chat) 6", "6", "3", "5", "0"]
    assert rows["verl.parquet"][:5] == ["verl (prompt) 5", "5", "1", "5", "0"]
    assert out.rstrip().endswith(f"{sum(len(v) for v in BAD.values())} bad record(s).")
    assert main(["data", "check", "obelics.parquet", "notes", "--no-progress"]) == 0
    assert "All records are good." in capsys.readouterr().out
    assert main(["data", "check", "nowhere.jsonl", "--no-progress"]) == 2  # a clear error, not a traceback
    assert "does not exist" in capsys.readouterr().err


def test_exact_token_counts_with_a_processor(user_data, proc):
    [estimate] = check([str(user_data["llava.json"])], progress=False)
    [exact] = check([str(user_data["llava.json"])], processor=proc, progress=False)
    assert exact.exact_tokens and not estimate.exact_tokens and exact.records == estimate.records == 6
    assert exact.tokens > 0 and 0.3 < estimate.tokens / exact.tokens < 3


def test_check_flags_chats_longer_than_a_row(tmp_path, proc):
    """Training skips a chat longer than a packed row, so the check lists it: against the longest preset row by
    default (the estimate without a tokenizer), against a given `seq_len` exactly with one."""
    import json

    from kimi_vl.data.check import DEFAULT_SEQ_LEN
    from kimi_vl.training.presets import PRESETS

    assert DEFAULT_SEQ_LEN == max(d.seq_len for p in PRESETS.values() for d in p.data.values())
    path = tmp_path / "long.jsonl"
    rows = [("word " * 30000, "ok"), ("short?", "yes"), ("a bit longer question, in a few words?", "fine")]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n" for q, a in rows))
    [report] = check([str(path)], progress=False)
    assert report.records == 2 and [(row, reason.split(" does")[0]) for _, row, reason in report.bad] == [
        (1, "chat of ~37,500 tokens (estimated; --tokenizer DIR counts them)")]
    assert "does not fit a row of seq_len=4096 (a chat is packed whole); raise --seq-len" in report.bad[0][2]
    [exact] = check([str(path)], processor=proc, progress=False, seq_len=24)  # the short chats: 17, 32
    assert [row for _, row, _ in exact.bad] == [1, 3] and exact.records == 1
    assert all(re.match(r"chat of [\d,]+ tokens does not fit a row of seq_len=24", r) for _, _, r in exact.bad)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))  # the short chats only
    assert main(["data", "check", str(path), "--no-progress"]) == 0
    assert main(["data", "check", str(path), "--seq-len", "8", "--no-progress"]) == 1  # ~2 and ~10 tokens estimated


def test_check_lists_rl_rows_the_reward_cannot_score(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_text('{"problem": "Big?", "answer": "1e400"}\n{"problem": "Sum?", "answer": "5"}\n'
                    '{"problem": "x", "answer": [1, 2]}\n{"problem": "Where?", "answer": "[[1,2,3]]"}\n')
    [report] = check([str(path)], progress=False)
    assert report.records == 1 and [row for _, row, _ in report.bad] == [1, 3, 4]


def test_an_empty_source_is_a_problem(tmp_path, capsys):
    """Training refuses a source without records ("has no records"), so the check does too (exit status 1)."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    (tmp_path / "good.jsonl").write_text('{"text": "a document"}\n')
    assert main(["data", "check", str(tmp_path / "good.jsonl"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["data", "check", *(str(tmp_path / n) for n in ("empty.jsonl", "blank.jsonl", "good.jsonl")),
                 "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'empty.jsonl'}: has no records (training refuses an empty source)" in out
    assert f"{tmp_path / 'blank.jsonl'}: has no records" in out
    assert out.rstrip().endswith(f"2 source(s) without any record: {tmp_path / 'empty.jsonl'}, "
                                 f"{tmp_path / 'blank.jsonl'}.")
    assert "All records are good" not in out
    assert f"| {tmp_path / 'empty.jsonl'} | - | 0 | 0 |" in out  # no record, so no bad record either


def test_check_flags_an_image_longer_than_a_row(tmp_path, proc):
    """Training skips a document whose image (or video chunk) is longer than a row, as a media block is never cut:
    the check lists it, by the default processors' estimate and exactly with a processor."""
    import json

    from tests.data.userdata import image

    image(0, w=448, h=448).save(tmp_path / "big.png")  # 64 tokens at proc's 256 patches, 256 at the default 1024
    image(1).save(tmp_path / "small.png")  # 12 tokens either way
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"A picture: <image>. {'Words. ' * 130}", "images": [name]}) + "\n"
                            for name in ("big.png", "small.png")))
    for seq_len, processor, tokens in ((200, None, 256), (60, proc, 64)):  # the small one's text is cut, trained on
        [report] = check([str(path)], processor=processor, progress=False, seq_len=seq_len)
        assert report.records == 1 and report.tokens > seq_len and [(row, reason) for _, row, reason in report.bad] == [
            (1, f"an image of {tokens} vision tokens does not fit in a row of seq_len={seq_len}; raise seq_len or "
                "lower the processor's max_patches")]
    [report] = check([str(path)], processor=proc, progress=False, seq_len=200)
    assert report.records == 2 and not report.bad
