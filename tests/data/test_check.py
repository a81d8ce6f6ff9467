"""`kimi-vl data check` on a folder of users' files in every schema: exactly the bad rows, per-source counts, the
exit status, and exact token counts with a tokenizer."""

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
