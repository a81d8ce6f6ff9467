"""MathVista: scoring of the official output file (every true_false and the whole scores file), query
construction, extraction rules, normalisation and local data loading."""

import json

import pytest
from PIL import Image

from kimi_vl.errors import ConfigError, DataError, DataUnavailableError, InvalidMediaError
from kimi_vl.eval import mathvista as mv


# ------------------------------------------------------------------------------------------- official files
def test_stored_extractions_reproduce_every_true_false(mathvista_outputs):
    assert len(mathvista_outputs) == 1000
    mismatches = [pid for pid, row in mathvista_outputs.items()
                  if mv.is_correct(row, row["extraction"]) != row["true_false"]]
    assert mismatches == []
    assert sum(row["true_false"] for row in mathvista_outputs.values()) == 261


def test_stored_predictions_match_except_the_old_integer_rule(mathvista_outputs):
    # The stored `prediction` fields predate the official `int(float(x))` integer rule (they used `int(x)`): four
    # integer rows with a decimal extraction differ, none of them changes a true_false.
    differ = {pid for pid, row in mathvista_outputs.items()
              if mv.score_problem(row, row["extraction"])["prediction"] != row["prediction"]}
    assert differ == {"246", "835", "983", "987"}
    assert all(mathvista_outputs[p]["answer_type"] == "integer" and mathvista_outputs[p]["prediction"] is None
               for p in differ)


def test_compute_scores_reproduces_the_official_scores_file(benchmark_samples, mathvista_outputs):
    official = json.loads((benchmark_samples / "mathvista" / "scores_llava_llama_2_13b.json").read_text(encoding="utf-8"))
    results = {pid: {**row, "true_false": mv.is_correct(row, row["extraction"])}
               for pid, row in mathvista_outputs.items()}
    scores = mv.compute_scores(results)
    assert scores == official
    for key in official:  # same order too (values sorted by accuracy, ties in first-appearance order)
        assert list(scores[key]) == list(official[key])
    assert mv.leaderboard(scores)["ALL"] == 26.1 and mv.leaderboard(scores)["GPS"] == 29.33


def test_query_construction_matches_the_official_queries(mathvista_outputs, mathvista_testmini):
    differ = [pid for pid, row in mathvista_outputs.items() if mv.build_query(mathvista_testmini[pid]) != row["query"]]
    # 990/1000 identical. For 10 multiple-choice problems the official query.json carries the choices of an older data
    # version (other order, sometimes other values) than the released testmini.json; everything before them is equal.
    assert len(differ) == 10
    for pid in differ:
        ours, official = mv.build_query(mathvista_testmini[pid]), mathvista_outputs[pid]["query"]
        assert ours.split("\nChoices:\n")[0] == official.split("\nChoices:\n")[0]
        assert ours.count("\n(") == official.count("\n(")


def test_query_hints_and_unit():
    base = {"pid": "x", "question": "How long? ", "unit": "cm", "choices": None, "precision": 2.0,
            "question_type": "free_form", "answer_type": "float"}
    assert mv.build_query(base) == f"Hint: {mv.HINT_FLOAT_2}\nQuestion: How long?  (Unit: cm)"  # question verbatim
    mc = {**base, "unit": None, "question_type": "multi_choice", "answer_type": "text", "choices": ["1", "2"]}
    assert mv.build_query(mc) == f"Hint: {mv.HINT_MULTI_CHOICE}\nQuestion: How long? \nChoices:\n(A) 1\n(B) 2"
    assert mv.build_query({**mc, "choices": None, "question_type": "free_form", "answer_type": "integer"}).endswith(
        "How long?")  # only the end of the whole query is stripped
    assert mv.query_of({**mc, "query": "given"}) == "given"
    with pytest.raises(ConfigError):
        mv.build_query({**base, "precision": 3})


# ------------------------------------------------------------------------------------------------ extraction
MC = {"pid": "1", "question": "Which?", "choices": ["red", "blue", "green"], "question_type": "multi_choice",
      "answer_type": "text", "precision": None, "unit": None, "answer": "blue"}
INT = {"pid": "2", "question": "How many?", "choices": None, "question_type": "free_form", "answer_type": "integer",
       "precision": None, "unit": None, "answer": "7"}
FLOAT = {**INT, "pid": "3", "answer_type": "float", "precision": 1, "answer": "1.2"}
LIST = {**INT, "pid": "4", "answer_type": "list", "answer": "[2007, 2008]"}


def test_official_rules():
    assert mv.extract_answer("", MC) == ""
    assert mv.extract_answer("blue", MC) == "blue"
    assert mv.extract_answer(" 7 ", INT) == "7"  # int() accepts surrounding whitespace
    assert mv.extract_answer("1.20", FLOAT) == "1.2"  # str(float(...))
    assert mv.rule_extract('The answer is "green".', MC) == "green"
    assert mv.rule_extract('The answer is "green".', MC, quick_extract=False) is None
    assert mv.rule_extract("It is 7 apples", INT) is None


def test_llm_extractor_gets_the_official_prompt():
    seen = []

    def llm(prompt):
        seen.append(prompt)
        return " 7 \n"

    assert mv.extract_answer("There are seven, i.e. 7 apples.", INT, llm=llm) == "7"
    query = mv.build_query(INT)
    assert seen == [mv.DEMO_PROMPT.strip() + f"\n\n{query}\n\nThere are seven, i.e. 7 apples.\n\nExtracted answer: "]
    assert mv.DEMO_PROMPT.strip().startswith("Please read the following example.")
    assert "line  graph" in mv.DEMO_PROMPT and mv.DEMO_PROMPT.strip().endswith("Extracted answer: B")

    def broken(prompt):
        raise RuntimeError("model crashed")

    assert mv.extract_answer("seven apples", INT, llm=broken) == ""  # officially: failures give ""


def test_heuristic_and_rules_only():
    assert mv.extract_answer("I think the answer is (B).", MC) == "B"
    assert mv.extract_answer("Answer is C, not A", MC) == "C"
    assert mv.extract_answer("Looking at it... (C) green is right.", MC) == "C"
    assert mv.extract_answer("the colour is blue", MC) == "blue"
    assert mv.extract_answer("2 + 5 = 7, so the answer is 7.", INT) == "7"
    assert mv.extract_answer("About 1,234.5 and then 1.2", FLOAT) == "1.2"
    assert mv.extract_answer("Peak between [2007, 2008].", LIST) == "[2007, 2008]"
    assert mv.extract_answer("no idea", INT) == ""
    assert mv.extract_answer("I think the answer is (B).", MC, heuristic=False) == ""


# --------------------------------------------------------------------------------------------- normalisation
def test_normalisation_and_correctness():
    assert mv.levenshtein("kitten", "sitting") == 3 and mv.levenshtein("", "abc") == 3
    assert mv.is_correct(MC, "B") and mv.is_correct(MC, "(B) blue") and mv.is_correct(MC, "(b)")
    assert mv.is_correct(MC, "bleu")  # nearest choice by edit distance
    assert not mv.is_correct(MC, "D")  # not an option letter: nearest choice to "D" is "red" (first of the ties)
    assert mv.most_similar_choice("", ["ab", "c", "d"]) == "c"
    assert mv.is_correct(INT, "7.0") and mv.is_correct(INT, "7.9") and not mv.is_correct(INT, "seven")
    assert mv.is_correct(FLOAT, "1.24") and not mv.is_correct(FLOAT, "1.26")
    assert mv.normalize_extracted_answer("x", None, "free_form", "float", None) is None  # unparseable -> None
    assert mv.is_correct(LIST, "[2007, 2008]") and not mv.is_correct(LIST, "[2007,2008]")
    assert mv.score_problem(INT, "7") == {"prediction": "7", "true_false": True}


def test_compute_scores_counts_each_skill_and_skips_missing_values():
    rows = {
        "1": {"question_type": "free_form", "answer_type": "integer", "true_false": True,
              "metadata": {"skills": ["a", "b"], "task": "t1", "context": None}},
        "2": {"question_type": "free_form", "answer_type": "integer", "true_false": False,
              "metadata": {"skills": ["b"], "task": "t2"}},
    }
    s = mv.compute_scores(rows)
    assert s["average"] == {"accuracy": "50.0", "correct": 1, "total": 2}
    assert s["skills"] == {"a": {"accuracy": "100.00", "correct": 1, "total": 1},
                           "b": {"accuracy": "50.00", "correct": 1, "total": 2}}
    assert s["context"] == {} and list(s["task"]) == ["t1", "t2"]


# ------------------------------------------------------------------------------------------------------ data
def test_local_testmini_json_and_images(tmp_path, mathvista_testmini):
    root = tmp_path / "mathvista"
    (root / "images").mkdir(parents=True)
    subset = {pid: mathvista_testmini[pid] for pid in ("1", "2")}
    (root / "testmini.json").write_text(json.dumps(subset), encoding="utf-8")
    Image.new("RGB", (20, 10), "red").save(root / "images" / "1.jpg")
    problems = mv.load_mathvista(tmp_path)
    assert list(problems) == ["1", "2"]
    assert mv.load_problem_image(problems["1"]).size == (20, 10)
    with pytest.raises(InvalidMediaError, match="images.zip") as info:
        mv.load_problem_image(problems["2"])
    # `images/2.jpg` under the data folder is where both forms of the path lead: it is listed once
    assert f"looked at [{str(root / 'images' / '2.jpg')!r}]" in str(info.value)
    assert list(mv.iter_ordered(problems, 1)) == ["1"]


def test_testmini_saved_with_save_to_disk_and_its_decoded_images(tmp_path, mathvista_testmini):
    """`DatasetDict.save_to_disk` of testmini with its `decoded_image` column (an Image feature) is read, images
    included."""
    datasets = pytest.importorskip("datasets")
    Image.new("RGB", (20, 10), "red").save(tmp_path / "1.png")
    rows = [{**mathvista_testmini["1"], "decoded_image": str(tmp_path / "1.png")}]
    ds = datasets.Dataset.from_list(rows).cast_column("decoded_image", datasets.Image())
    datasets.DatasetDict({"testmini": ds}).save_to_disk(tmp_path / "data" / "mathvista")
    problems = mv.load_mathvista(tmp_path / "data")
    assert list(problems) == ["1"] and problems["1"]["answer"] == mathvista_testmini["1"]["answer"]
    assert mv.load_problem_image(problems["1"]).getpixel((5, 5)) == (255, 0, 0)


def test_empty_testmini_is_refused(tmp_path):
    (tmp_path / "mathvista").mkdir()
    for text in ("{}", "[]"):
        (tmp_path / "mathvista" / "testmini.json").write_text(text, encoding="utf-8")
        with pytest.raises(DataUnavailableError, match=r"^no testmini rows in \S*mathvista/testmini.json; put the "
                                                       r"MathVista testmini problems there"):
            mv.load_mathvista(tmp_path)


def test_rows_without_pid_or_answer_and_shared_pids_name_the_row(tmp_path):
    root = tmp_path / "mathvista"
    root.mkdir()
    path = root / "testmini.json"
    no_answer = {k: v for k, v in FLOAT.items() if k != "answer"}
    for rows, match in (([INT, no_answer], r"testmini.json:2: the problem lacks `answer`; fix the row"),
                        ([INT, {**FLOAT, "pid": INT["pid"]}], r"testmini.json:2: pid '2' is used by two problems")):
        path.write_text(json.dumps(rows), encoding="utf-8")
        with pytest.raises(DataError, match=match):  # the second would have replaced the first, silently
            mv.load_mathvista(tmp_path)
    path.write_text(json.dumps([INT, FLOAT]), encoding="utf-8")
    assert list(mv.load_mathvista(tmp_path)) == ["2", "3"]


def test_constant_answer_baseline():
    """Without reading: uniform guessing gets 1 / choices on multiple choice and nothing on free form; the best
    constant answer (the letter most often right, the most frequent free-form answer) gets their counts, scored
    like any answer: (D) on the two-choice problem is the choice nearest to "D", `p`, and right there too."""
    from kimi_vl.eval.mathvista import baselines

    problems = {
        "1": {"question_type": "multi_choice", "answer_type": "text", "choices": ["a", "b", "c", "d"], "answer": "d"},
        "2": {"question_type": "multi_choice", "answer_type": "text", "choices": ["x", "y", "z", "w"], "answer": "w"},
        "3": {"question_type": "multi_choice", "answer_type": "text", "choices": ["p", "q"], "answer": "p"},
        "4": {"question_type": "free_form", "answer_type": "integer", "choices": None, "answer": "3"},
        "5": {"question_type": "free_form", "answer_type": "integer", "choices": None, "answer": "3"},
        "6": {"question_type": "free_form", "answer_type": "integer", "choices": None, "answer": "7"},
    }
    b = baselines(problems)
    assert b["chance"] == pytest.approx((0.25 + 0.25 + 0.5) / 6) and b["constant"] == pytest.approx(5 / 6)
    assert b["constant_answer"] == "(D) on multiple choice, 3 on free form"


def test_constant_answer_baseline_is_what_the_scorer_gives_that_answer():
    """The constant answer's score is the official scorer's: the free-form answer `6.0` is also right on the integer
    answer `6` (`int(float("6.0"))`), so it is right 3 times, not the 2 its string occurs."""
    def free(answer, answer_type="integer", precision=None):
        return {"question_type": "free_form", "answer_type": answer_type, "precision": precision, "choices": None,
                "answer": answer}

    problems = dict(enumerate([free("6"), free("6.0", "float", 1), free("6.0", "float", 1), free("7"), free("7"),
                               free("2.5", "float", 1)]))
    b = mv.baselines(problems)
    assert b["constant_answer"] == "6.0 on free form" and b["constant"] == pytest.approx(3 / 6)
    assert b["constant"] == pytest.approx(sum(mv.is_correct(p, "6.0") for p in problems.values()) / 6)
