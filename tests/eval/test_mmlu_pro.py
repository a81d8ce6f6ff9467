"""MMLU-Pro: answer extraction against the official result dump, the 5-shot prompt against the official template,
scoring, local data loading, and the offline hub failure."""

import json
import random
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kimi_vl.errors import BadRecordError, ConfigError, DataError
from kimi_vl.eval import mmlu_pro as mp
from kimi_vl.eval.data import DataUnavailableError

# Worked examples written for the fixture's math rows (the fixture has test rows only; validation rows carry these).
COT = {
    7918: "A: Let's think step by step. 22 / 2 = 11 and 11 + 9 = 20. The answer is (H).",
    8790: "A: Let's think step by step. A negative times a negative is positive: 8 \u2022 4 = 32. The answer is (I).",
    7818: "A: Let's think step by step. The opposite of \u22127 is 7. The answer is (F).",
    8156: "A: Let's think step by step. 72 = 2^3 * 3^2 gives 3 * 2 = 6 groups. The answer is (C).",
    8593: "A: Let's think step by step. The fractions add up to 2k - 1, plus 3k + 1 gives 5k. The answer is (E).",
    8063: "A: Let's think step by step. The product telescopes to 2. The answer is (B).",
    10717: "A: Let's think step by step. 8 >> 1 is 8 // 2 = 4. The answer is (E).",
}
VALIDATION_IDS = [10717, 7918, 8790, 7818, 8156, 8593, 8063]  # a computer-science row first; 6 math rows
TEST_ID = 8239

# The official format, written out: header + 4 newlines, 5 shots "Question:\n...\nOptions:\nA. ...\n" + cot (with
# "A: Let's think step by step." -> "Answer: Let's think step by step.") + "\n\n", then the question ending in
# "Answer: Let's think step by step." The "N/A" padding option of the test row is dropped.
EXPECTED_5_SHOT = (
    'The following are multiple choice questions (with answers) about math. Think step by step and then finish your '
    'answer with "the answer is (X)" where X is the correct letter choice.\n\n\n\n'
    "Question:\nCompute 22 / 2 + 9.\nOptions:\n"
    "A. 24\nB. 23\nC. 21\nD. 22\nE. 10\nF. 25\nG. 2\nH. 20\nI. 19\nJ. 11\n"
    "Answer: Let's think step by step. 22 / 2 = 11 and 11 + 9 = 20. The answer is (H).\n\n"
    "Question:\nFind the product of \u22128 \u2022 (\u22124).\nOptions:\n"
    "A. 28\nB. 16\nC. 36\nD. -36\nE. -28\nF. \u221232\nG. -16\nH. 4\nI. 32\nJ. \u22124\n"
    "Answer: Let's think step by step. A negative times a negative is positive: 8 \u2022 4 = 32. The answer is (I).\n\n"
    "Question:\nFind the opposite of the number \u22127.\nOptions:\n"
    "A. \u22120.77\nB. \u221214\nC. \u22127\nD. 0.7\nE. 14\nF. 7\nG. \u22120.07\nH. \u22127.7\nI. 0.77\nJ. 70\n"
    "Answer: Let's think step by step. The opposite of \u22127 is 7. The answer is (F).\n\n"
    "Question:\nHow many structurally distinct Abelian groups have order 72?\nOptions:\n"
    "A. 7\nB. 4\nC. 6\nD. 10\nE. 5\nF. 11\nG. 9\nH. 12\nI. 8\nJ. 15\n"
    "Answer: Let's think step by step. 72 = 2^3 * 3^2 gives 3 * 2 = 6 groups. The answer is (C).\n\n"
    "Question:\nSimplify $\\frac{k-3}{2} + 3k+1+\\frac{3k+1}{2}$.\nOptions:\n"
    "A. 3k+1\nB. 2k\nC. 5k+1\nD. 7k\nE. 5k\nF. 4k+1\nG. 6k+1\nH. 1\nI. 2k+2\nJ. 3k\n"
    "Answer: Let's think step by step. The fractions add up to 2k - 1, plus 3k + 1 gives 5k. The answer is (E).\n\n"
    "Question:\nWhen n = 11, what is the value of 10 \u2013 (n + 6)?\nOptions:\n"
    "A. 3\nB. 0\nC. 5\nD. \u20137\nE. -5\nF. 1\nG. 27\nH. 7\nI. -3\nJ. 15\n"
    "Answer: Let's think step by step."
)


def _schema_row(row: dict, cot: str = "", pad: int = 0) -> dict:
    """A row in the dataset's schema (the dump's extra fields dropped; optional "N/A" padding)."""
    keep = ("question_id", "question", "options", "answer", "answer_index", "category", "src")
    out = {k: row[k] for k in keep}
    out["options"] = list(row["options"]) + ["N/A"] * pad
    out["cot_content"] = cot
    return out


@pytest.fixture()
def mmlu_dir(tmp_path, mmlu_fixture_rows):
    """DIR/mmlu_pro/test-00000-of-00001.parquet + DIR/mmlu_pro/validation.jsonl from the fixture rows."""
    by_id = {r["question_id"]: r for r in mmlu_fixture_rows}
    test = [_schema_row(by_id[TEST_ID], pad=2), _schema_row(by_id[10549]), _schema_row(by_id[150])]
    val = [_schema_row(by_id[q], COT[q]) for q in VALIDATION_IDS]
    root = tmp_path / "mmlu_pro"
    root.mkdir()
    pq.write_table(pa.Table.from_pylist(test), root / "test-00000-of-00001.parquet")
    (root / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val), encoding="utf-8")
    return tmp_path


# ------------------------------------------------------------------------------------------- official dump
def test_level1_reproduces_official_pred(mmlu_fixture_rows):
    assert len(mmlu_fixture_rows) == 700
    mismatches = [r["question_id"] for r in mmlu_fixture_rows
                  if mp.extract_answer(r["generated_text"], level=1) != r["pred"]]
    assert mismatches == []
    assert sum(r["pred"] is None for r in mmlu_fixture_rows) == 102


def test_level3_agrees_where_official_pred_exists(mmlu_fixture_rows):
    with_pred = [r for r in mmlu_fixture_rows if r["pred"] is not None]
    assert len(with_pred) == 598
    assert all(mp.extract_answer(r["generated_text"], level=3) == r["pred"] for r in with_pred)
    # the later levels recover some of the level-1 failures
    recovered = [r for r in mmlu_fixture_rows if r["pred"] is None and mp.extract_answer(r["generated_text"]) is not None]
    assert len(recovered) > 0


def test_extraction_levels():
    assert mp.extract_answer("so the answer is (C). Then the answer is D") == "C"
    assert mp.extract_answer("The answer is B") == "B"
    text = "Reasoning.\nAnswer: D\nmore text Answer: E"
    assert mp.extract_answer(text, level=1) is None
    assert mp.extract_answer(text, level=2) == "D"  # first line with a match, greedy within it
    assert mp.extract_answer("x Answer: A then Answer:  B\nAnswer: C", level=2) == "B"
    assert mp.extract_answer("I think it is G, or maybe\nH.", level=2) is None
    assert mp.extract_answer("I think it is G, or maybe\nH.", level=3) == "H"
    assert mp.extract_answer("All options look wrong.", level=3) is None  # "A" inside "All" is not standalone
    assert mp.extract_answer("", level=3) is None
    with pytest.raises(ConfigError):
        mp.extract_answer("the answer is (A)", level=4)


def test_random_guess_is_the_official_reseeded_draw():
    state = random.getstate()
    for n in (1, 4, 10):
        random.seed(12345)
        expected = random.randint(0, n - 1)
        random.setstate(state)
        assert mp.random_guess(n) == expected
    assert random.getstate() == state


def test_score_micro_average_and_categories(mmlu_fixture_rows):
    records = [dict(r) for r in mmlu_fixture_rows]
    result = mp.score(records)
    assert result["total"] == 700 and result["random_guesses"] == 102
    assert set(result["categories"]) == set(mp.CATEGORIES)
    assert all(c["total"] == 50 for c in result["categories"].values())
    expected = sum(
        (r["pred"] == r["answer"]) if r["pred"] else (mp.random_guess(len(r["options"])) == r["answer_index"])
        for r in records
    )
    assert result["correct"] == expected
    assert result["accuracy"] == pytest.approx(expected / 700)
    assert sum(c["correct"] for c in result["categories"].values()) == expected


# -------------------------------------------------------------------------------------------------- prompts
def test_five_shot_prompt_matches_official_template(mmlu_dir):
    test, val = mp.load_mmlu_pro(mmlu_dir)
    row = next(r for r in test if r["question_id"] == TEST_ID)
    assert "N/A" not in row["options"] and len(row["options"]) == 10
    assert mp.build_prompt(val, row, 5) == EXPECTED_5_SHOT


def test_shot_budget_drops_shots_until_the_prompt_fits(mmlu_dir):
    test, val = mp.load_mmlu_pro(mmlu_dir)
    row = next(r for r in test if r["question_id"] == TEST_ID)
    full = mp.build_prompt(val, row, 5)
    prompt, shots = mp.build_prompt_within_budget(val, row, len, max_model_length=len(full) + 10, max_new_tokens=10)
    assert (prompt, shots) == (mp.build_prompt(val, row, 4), 4)  # len(full) is not < budget
    prompt, shots = mp.build_prompt_within_budget(val, row, len, max_model_length=100, max_new_tokens=50)
    assert shots == 0 and prompt.endswith("Answer: Let's think step by step.") and prompt.count("Question:") == 1


def test_ordered_items_round_robin(mmlu_dir):
    test, _ = mp.load_mmlu_pro(mmlu_dir)
    assert [r["category"] for r in mp.ordered_items(test)] == ["business", "computer science", "math"]
    assert [r["category"] for r in mp.ordered_items(test, limit=2)] == ["business", "computer science"]
    with pytest.raises(ConfigError):
        mp.ordered_items(test, limit=-1)


# --------------------------------------------------------------------------------------------------- data
def test_a_dataset_dict_saved_with_save_to_disk_is_read(mmlu_dir, tmp_path):
    """`DatasetDict.save_to_disk(DIR/mmlu_pro)` (a folder per split, Arrow files and state.json) gives the same rows
    as the parquet / JSONL files it was made from."""
    datasets = pytest.importorskip("datasets")
    test, val = mp.load_mmlu_pro(mmlu_dir)
    raw = {"test": pq.read_table(mmlu_dir / "mmlu_pro" / "test-00000-of-00001.parquet").to_pylist(),
           "validation": [json.loads(line) for line in (mmlu_dir / "mmlu_pro" / "validation.jsonl").open()]}
    saved = tmp_path / "saved"
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in raw.items()}).save_to_disk(saved / "mmlu_pro")
    assert mp.load_mmlu_pro(saved) == (test, val) and len(test) == 3 and len(val) == len(VALIDATION_IDS)


def test_missing_local_files_say_what_to_pass(tmp_path):
    with pytest.raises(DataUnavailableError, match="validation"):
        (tmp_path / "mmlu_pro").mkdir()
        (tmp_path / "mmlu_pro" / "test.jsonl").write_text("")
        mp.load_mmlu_pro(tmp_path)


def test_hub_unreachable_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    start = time.monotonic()
    with pytest.raises(DataUnavailableError, match="--data-dir"):
        mp.load_mmlu_pro(None)
    assert time.monotonic() - start < 10


def test_constant_answer_baseline():
    from kimi_vl.eval.mmlu_pro import baselines

    rows = [{"answer": a, "options": ["o"] * n} for a, n in (("C", 10), ("C", 10), ("A", 4), ("B", 10))]
    b = baselines(rows)
    assert b["constant"] == 0.5 and b["constant_answer"] == "always (C)"
    assert b["chance"] == pytest.approx((0.1 + 0.1 + 0.25 + 0.1) / 4)


def _write_split(root, name, rows):
    (root / "mmlu_pro").mkdir(exist_ok=True)
    (root / "mmlu_pro" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


GOOD_ROW = {"question_id": 1, "question": "What is 1+1?", "options": ["1", "2", "3", "N/A"], "answer": "B",
            "answer_index": 1, "cot_content": "A: Let's think step by step. The answer is (B).", "category": "math",
            "src": "x"}


@pytest.mark.parametrize(("change", "reason"), [
    ({"options": None}, r"`options` must be a list of option texts, got None"),
    ({"options": "ABCD"}, r"`options` must be a list of option texts, got 'ABCD'"),  # not split into letters
    ({"options": ["1", 2]}, r"`options` must be a list of option texts"),
    ({"options": []}, r"`options` has no option"),
    ({"options": ["N/A", "N/A"]}, r"`options` has no option"),
    ({"category": None}, r"`category` must be non-empty text"),
    ({"category": ""}, r"`category` must be non-empty text"),
    ({"question": 7}, r"`question` must be text"),
    ({"answer": 1}, r"`answer` must be the letter of the option at answer_index 1, 'B', got 1"),
    ({"answer": "C"}, r"`answer` must be the letter .* got 'C'"),
    ({"answer": "J", "answer_index": 9}, r"`answer_index` must be the position .* in `options`, from 0 to 3, got 9"),
    ({"answer_index": "1"}, r"`answer_index` must be"),
    ({"answer_index": True}, r"`answer_index` must be"),
])
def test_malformed_test_rows_name_the_file_and_row(tmp_path, change, reason):
    """Every row is checked on loading (not only the first): a malformed one is a DataError naming the file, the
    row and the fix, raised before any prompt is built."""
    _write_split(tmp_path, "test", [GOOD_ROW, {**GOOD_ROW, "question_id": 2, **change}])
    _write_split(tmp_path, "validation", [GOOD_ROW])
    path = tmp_path / "mmlu_pro" / "test.jsonl"
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: test row \(question_id 2\): {reason}"
                                        r".*; fix the row or remove it \(MMLU-Pro rows:") as info:
        mp.load_mmlu_pro(tmp_path)
    assert isinstance(info.value, BadRecordError) and (info.value.file, info.value.row) == (str(path), 2)


def test_missing_fields_of_any_row_and_malformed_validation_rows(tmp_path):
    rows = [GOOD_ROW, {k: v for k, v in GOOD_ROW.items() if k not in ("options", "answer")}]
    _write_split(tmp_path, "test", rows)
    _write_split(tmp_path, "validation", [GOOD_ROW])
    with pytest.raises(DataError, match=r"test.jsonl:2: test row \(question_id 1\) lacks the fields options, answer;"):
        mp.load_mmlu_pro(tmp_path)
    _write_split(tmp_path, "test", [GOOD_ROW])
    test, val = mp.load_mmlu_pro(tmp_path)  # valid rows load as before: the "N/A" padding dropped
    assert test[0]["options"] == ["1", "2", "3"] and val[0]["options"] == ["1", "2", "3"]
    _write_split(tmp_path, "validation", [GOOD_ROW, {**GOOD_ROW, "cot_content": None}])
    with pytest.raises(DataError, match=r"validation.jsonl:2: validation row \(question_id 1\): `cot_content` must"):
        mp.load_mmlu_pro(tmp_path)
    assert mp.load_mmlu_pro(tmp_path, validation=False)[0] == test  # 0-shot: the validation rows are not read
    _write_split(tmp_path, "validation", [{k: v for k, v in GOOD_ROW.items() if k != "category"}])
    with pytest.raises(DataError, match=r"validation.jsonl:1: validation row .* lacks the field category;"):
        mp.load_mmlu_pro(tmp_path)


def test_official_rows_pass_the_row_check(mmlu_fixture_rows):
    assert [r["question_id"] for r in mmlu_fixture_rows if mp.check_row(r) is not None] == []


def test_empty_splits_are_refused(tmp_path):
    _write_split(tmp_path, "test", [])
    _write_split(tmp_path, "validation", [GOOD_ROW])
    with pytest.raises(DataUnavailableError, match=r"^no test rows in \S*mmlu_pro/test.jsonl; put the MMLU-Pro test"):
        mp.load_mmlu_pro(tmp_path)
    with pytest.raises(DataUnavailableError, match=r"^no test rows in"):
        mp.load_mmlu_pro(tmp_path, validation=False)
    _write_split(tmp_path, "test", [GOOD_ROW])
    _write_split(tmp_path, "validation", [])
    with pytest.raises(DataUnavailableError,
                       match=r"^no validation rows in \S*validation.jsonl; .*`kimi-vl eval --num-shots 0`; the quick"):
        mp.load_mmlu_pro(tmp_path)


def test_hub_rows_are_checked_too(monkeypatch):
    hub = {"test": [GOOD_ROW, {**GOOD_ROW, "options": "ABCD"}], "validation": [GOOD_ROW]}
    monkeypatch.setattr(mp, "load_hub_dataset", lambda *args, **kwargs: hub)
    with pytest.raises(DataError, match=r"^TIGER-Lab/MMLU-Pro test split:2: test row .*`options` must be a list"):
        mp.load_mmlu_pro(None)
    hub["test"] = []
    with pytest.raises(DataUnavailableError, match=r"^no test rows in TIGER-Lab/MMLU-Pro"):
        mp.load_mmlu_pro(None)
