"""Verifiable rewards (`kimi_vl.training.rewards`): extraction and every scorer against hand-computed values."""

import random
from dataclasses import dataclass, field

import pytest

from kimi_vl.errors import ConfigError
from kimi_vl.training.rewards import (
    box_iou,
    choice_reward,
    count_reward,
    exact_reward,
    extract_answer,
    extract_boxes,
    extract_choice,
    extract_html,
    extract_number,
    format_reward,
    grounding_reward,
    html_reward,
    last_boxed,
    levenshtein,
    max_weight_matching,
    normalise_text,
    number_reward,
    ocr_reward,
    parse_numbers,
    reward,
    soft_f1,
    token_budget,
    token_f1,
    true_boxes,
    true_number,
)


@dataclass
class Stub:
    """Stand-in for `kimi_vl.data.world.Sample` (rewards only read these attributes)."""

    reward: str
    answer: str
    choices: list | None = None
    meta: dict = field(default_factory=dict)
    task: str = "t"


# --------------------------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize("text, expected", [
    ("Let's think step by step. The answer is (C).", "C"),
    ("The answer is (A). Wait, no: the answer is (D).", "D"),  # the last statement wins
    ("the answer is B", "B"),
    ("Answer: E", "E"),
    ("I'd go with G in the end", "G"),  # last standalone letter (I is also one, G comes last)
    ("the answer is Because of x", None),  # a word starting with B is not a choice; no standalone letter either
    ("nothing here", None),
])
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


def test_extract_choice_limits_letters():
    assert extract_choice("the answer is (E)", num_choices=4) is None
    assert extract_choice("A or E? the answer is (E)", num_choices=4) == "A"


@pytest.mark.parametrize("text, expected", [
    ("2 + 3 = 5, so the answer is 5.", 5.0),
    ("The answer is 3.5 cm, not 4", 3.5),  # first number after the last "answer is"
    ("there are 1,234 apples", 1234.0),
    ("from 3 to -2", -2.0),
    ("3-5 is negative", 5.0),  # "-5" after a digit is subtraction, not a sign
    ("x2 and .5", 0.5),
    ("no digits", None),
])
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_parse_numbers():
    assert parse_numbers("1+2=3, 1e3 and −4") == [1.0, 2.0, 3.0, 1000.0, -4.0]


def test_extract_answer():
    assert extract_answer('It says so. The answer is "Hello World".') == "Hello World"
    assert extract_answer("The answer is (B).") == "B"
    assert extract_answer("The Answer is: STOP.\nmore text") == "STOP"
    assert extract_answer("  just text  ") == "just text"


def test_extract_boxes_and_html():
    assert extract_boxes("boxes [1, 2, 3, 4] ... The answer is [[10, 20, 30, 40], [0,0,5,5]].") == [
        [10.0, 20.0, 30.0, 40.0], [0.0, 0.0, 5.0, 5.0]]
    assert extract_boxes("[100,200,300,400]") == [[100.0, 200.0, 300.0, 400.0]]  # not the number 100200300400
    assert extract_boxes("[1, 2, 3]") == []
    assert extract_html("Here:\n```html\n<p>x</p>\n```") == "<p>x</p>"
    assert extract_html("page: <div>a</div> done") == "<div>a</div>"
    assert extract_html("no tags") == ""


# ----------------------------------------------------------------------------------------------------------- scorers
def test_choice_reward():
    assert choice_reward("The answer is (B).", "B") == 1.0
    assert choice_reward("The answer is (B).", "b") == 1.0
    assert choice_reward("The answer is (C).", "B") == 0.0
    assert choice_reward("no idea", "B") == 0.0


def test_number_reward_tolerance():
    assert number_reward("The answer is 7", "7") == 1.0
    assert number_reward("The answer is 7.0004", "7", rel_tol=1e-4) == 1.0   # |d| = 4e-4 <= 7e-4
    assert number_reward("The answer is 7.001", "7", rel_tol=1e-4) == 0.0    # 1e-3 > 7e-4
    assert number_reward("The answer is 99", "100") == 0.0
    assert number_reward("The answer is 99", "100", rel_tol=0.01) == 1.0
    # an integer truth needs the integer: 1e-4 of a large one would pass a neighbour (a units conversion's 10080)
    assert number_reward("The answer is 10001", "10000") == 0.0 and number_reward("The answer is 10080", "10080") == 1.0
    assert number_reward("The answer is 10000.0", "10000") == 1.0
    assert number_reward("The answer is 2.50001", "2.5") == 1.0 and number_reward("The answer is 2.6", "2.5") == 0.0
    # precision 1: half a unit of the last place, 0.05
    assert number_reward("The answer is 3.46", "3.5", precision=1) == 1.0
    assert number_reward("The answer is 3.44", "3.5", precision=1) == 0.0
    assert number_reward("no number", "3") == 0.0
    with pytest.raises(ConfigError, match="holds no number"):
        number_reward("3", "three")


@pytest.mark.parametrize("response, truth, expected", [
    ("4", "4", 1.0), ("3", "4", 0.75), ("5", "4", 0.75), ("8", "4", 0.0), ("12", "4", 0.0),
    ("1", "0", 0.0), ("0", "0", 1.0), ("There are 9.", "10", 0.9), ("none", "3", 0.0),
])
def test_count_reward(response, truth, expected):
    assert count_reward(response, truth) == pytest.approx(expected)


def test_levenshtein_and_ocr():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0
    assert normalise_text("  Hello \n  WORLD ") == "hello world"
    assert ocr_reward("The answer is HELLO", "HELLO") == 1.0
    assert ocr_reward("The answer is helo", "HELLO") == pytest.approx(1 - 1 / 5)
    assert ocr_reward("The answer is Hello   world.", "HELLO WORLD") == 1.0  # case, spaces, final period
    assert ocr_reward("The answer is abcd", "wxyz") == 0.0
    assert ocr_reward("kitten", "sitting") == pytest.approx(1 - 3 / 7)


def test_box_iou():
    assert box_iou([0, 0, 2, 2], [1, 1, 3, 3]) == pytest.approx(1 / 7)
    assert box_iou([0, 0, 2, 2], [2, 2, 0, 0]) == 1.0  # corners in either order
    assert box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert box_iou([0, 0, 0, 5], [0, 0, 0, 5]) == 0.0  # degenerate


def test_max_weight_matching_is_optimal_not_greedy():
    # Greedy would take (0, 0) = 0.9 and then (1, 1) = 0.1 (sum 1.0); the optimum is 0.8 + 0.85 = 1.65.
    assert max_weight_matching([[0.9, 0.8], [0.85, 0.1]]) == [(0, 1), (1, 0)]
    assert max_weight_matching([[0.1], [0.5], [0.3]]) == [(1, 0)]
    assert max_weight_matching([[0.2, 0.7, 0.1]]) == [(0, 1)]
    assert max_weight_matching([]) == []


def test_soft_f1_hand_computed():
    truth = [[0, 0, 2, 2], [10, 10, 12, 12]]
    assert soft_f1(truth, truth) == 1.0
    # one perfect box, one box with IoU 1/7 with the second truth: S = 8/7, P = R = 4/7
    assert soft_f1([[0, 0, 2, 2], [11, 11, 13, 13]], truth) == pytest.approx(4 / 7)
    # one true box, two predictions, best IoU 0.5: P = 0.25, R = 0.5, F1 = 1/3
    assert soft_f1([[0, 0, 2, 1], [5, 5, 6, 6]], [[0, 0, 2, 2]]) == pytest.approx(1 / 3)
    assert soft_f1([], []) == 1.0
    assert soft_f1([], truth) == 0.0
    assert soft_f1(truth, []) == 0.0


def test_grounding_reward():
    response = "The boxes are listed. The answer is [[0, 0, 2, 2], [11, 11, 13, 13]]."
    truth = [[0, 0, 2, 2], [10, 10, 12, 12]]
    assert grounding_reward(response, truth) == pytest.approx(4 / 7)
    assert grounding_reward(response, "[[0, 0, 2, 2], [10, 10, 12, 12]]") == pytest.approx(4 / 7)
    assert grounding_reward("no boxes", truth) == 0.0


def test_true_answers_are_read_strictly():
    """A ground truth the scorer cannot use is an error, never a silently different truth: a malformed box is not
    dropped, an infinite number is not taken for another (`kimi_vl.data.formats` refuses such rows by these)."""
    assert true_boxes("[[0, 0, 2, 2], [10, 10, 12, 12]]") == [[0, 0, 2, 2], [10, 10, 12, 12]]
    with pytest.raises(ConfigError, match=r"box \[5,6\], which is not four numbers"):
        grounding_reward("[[1,2,3,4]]", "[[1,2,3,4],[5,6]]")
    with pytest.raises(ConfigError, match="not four numbers"):
        true_boxes("[[1,2,3]]")
    with pytest.raises(ConfigError, match="holds no box"):
        true_boxes("[[]]")
    assert grounding_reward("[[1,2,3,4]]", "[[1,2,3,4]]") == 1.0
    assert true_number("12.5 cm") == 12.5 and true_number(3) == 3.0
    with pytest.raises(ConfigError, match=r"holds no finite number \(1e400 is out of a float's range\)"):
        number_reward("The answer is 5", "1e400")
    with pytest.raises(ConfigError, match="holds no number"):
        true_number("v2.0.1")
    with pytest.raises(ConfigError, match="not a finite number"):
        true_number(float("inf"))


def test_html_reward():
    page = "<div><h1>My Page</h1><p>hello world</p></div>"
    assert html_reward(page, page) == 1.0
    assert html_reward(f"```html\n{page}\n```", page) == 1.0
    assert html_reward("no html at all", page) == 0.0
    # same tags, half of the words: tags 1.0, text F1 of {my, page} vs {my, page, hello, world} = 2/3
    assert html_reward("<div><h1>My Page</h1><p></p></div>", page) == pytest.approx(0.5 + 0.5 * (2 / 3))
    # tag sequences div h1 /h1 /div vs div h1 /h1 p /p /div: ratio 2*4/(4+6) = 0.8; same words -> 1.0
    assert html_reward("<div><h1>My Page hello world</h1></div>", page) == pytest.approx(0.5 * 0.8 + 0.5)
    assert token_f1(["a", "b"], ["a", "c"]) == 0.5


def test_format_reward():
    assert format_reward("The answer is (B)", "choice") == 1.0
    assert format_reward("hmm", "choice") == 0.0
    assert format_reward("it is 4", "count") == 1.0
    assert format_reward("four", "number") == 0.0
    assert format_reward("The answer is HELLO", "ocr") == 1.0
    assert format_reward("HELLO", "ocr") == 0.0
    assert format_reward("[[1, 2, 3, 4]]", "grounding") == 1.0
    assert format_reward("<p>x</p>", "html") == 1.0
    with pytest.raises(ConfigError, match="unknown reward kind"):
        format_reward("x", "poem")


def test_token_budget():
    assert token_budget(1.0, 10, 10) == 1.0
    assert token_budget(1.0, 11, 10) == 0.0
    assert token_budget(0.8, 15, 10, soft=True) == pytest.approx(0.4)
    assert token_budget(0.8, 25, 10, soft=True) == 0.0
    with pytest.raises(ConfigError, match="positive"):
        token_budget(1.0, 1, 0)


# ----------------------------------------------------------------------------------------------------------- dispatch
def test_reward_dispatch():
    assert reward(Stub("choice", "B", choices=["x", "y", "z"]), "The answer is (B).") == 1.0
    assert reward(Stub("choice", "B", choices=["x", "y"]), "A or B? Answer: C") == 1.0  # C is not an option: last letter B
    assert reward(Stub("number", "3.5", meta={"precision": 1}), "The answer is 3.46") == 1.0
    assert reward(Stub("count", "4"), "I count 3 circles.") == 0.75
    assert reward(Stub("ocr", "HELLO"), "The answer is HELO") == pytest.approx(0.8)
    boxes = [[0, 0, 2, 2]]
    assert reward(Stub("grounding", "[[0, 0, 2, 2]]"), "The answer is [[0, 0, 2, 1]]") == pytest.approx(0.5)
    assert reward(Stub("grounding", "ignored", meta={"boxes": boxes}), "The answer is [[0, 0, 2, 2]]") == 1.0
    assert reward(Stub("html", "<p>hi</p>"), "<p>hi</p>") == 1.0


def test_reward_with_token_budget():
    sample = Stub("number", "7")
    assert reward(sample, "The answer is 7", max_tokens=8, num_tokens=8) == 1.0
    assert reward(sample, "The answer is 7", max_tokens=8, num_tokens=9) == 0.0
    assert reward(sample, "The answer is 7", max_tokens=8, num_tokens=12, soft_budget=True) == 0.5
    with pytest.raises(ConfigError, match="both"):
        reward(sample, "7", max_tokens=8)


def test_reward_unknown_kind():
    with pytest.raises(ConfigError, match="choice, number, count, ocr, exact, grounding, html"):
        reward(Stub("vibes", "x"), "x")


def test_world_target_responses_score_one():
    """The synthetic world's target responses are in the formats the extractors read (every task, several seeds)."""
    world = pytest.importorskip("kimi_vl.data.world")
    for task in world.ALL_TASKS:
        for seed in range(5):
            sample = world.make_sample(task, random.Random(seed))
            assert reward(sample, sample.response) == pytest.approx(1.0), (task, sample.response[:200], sample.answer)
            assert format_reward(sample.response, sample.reward) == 1.0


def test_boxed_answers_and_the_exact_reward():
    """`\\boxed{}` (verl-style math prompts) wins over "answer is"; `exact` compares normalised texts."""
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{3}{2}} end") == r"\frac{3}{2}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None
    assert extract_number(r"The answer is 3. Finally \boxed{12}.") == 12.0
    assert extract_answer(r"so x = \boxed{ABC}") == "ABC"
    assert exact_reward(r"so x = \boxed{ Abc  }", "abc") == 1.0 and exact_reward("The answer is Abd.", "abc") == 0.0
    assert reward(Stub("exact", "Paris"), "The answer is paris.") == 1.0
    assert format_reward(r"\boxed{x}", "exact") == 1.0 and format_reward("nothing", "exact") == 0.0


@pytest.mark.parametrize("truth, response, expected", [
    ("0.5", r"so \boxed{\frac{1}{2}}", 1.0),  # a right fraction was scored by its first number, 1
    ("0.5", r"\boxed{1/2}", 1.0),
    ("-0.5", r"\boxed{-\dfrac{1}{2}}", 1.0),
    ("2", r"\boxed{\frac{2}{3}}", 0.0),  # a wrong answer was scored by its first number, 2
    ("2", r"\boxed{2\sqrt{3}}", 0.0),
    ("10", r"\boxed{10^{3}}", 0.0),
    ("1000", r"\boxed{1{,}000}", 1.0),
    ("12", r"\boxed{12\,\text{cm}^2}", 1.0),
    ("60", r"\boxed{60^\circ}", 1.0),
    ("5", r"\boxed{x = 5}", 1.0),
    (r"\frac{3}{4}", r"\boxed{0.75}", 1.0),  # a LaTeX truth is its value, not its first number 3
])
def test_number_reward_reads_the_whole_boxed_answer(truth, response, expected):
    assert reward(Stub("number", truth), response) == expected


@pytest.mark.parametrize("truth, response", [
    (r"\frac{1}{2}", r"\boxed{\dfrac{1}{2}}"),
    (r"\frac{1}{2}", r"\boxed{0.5}"),
    ("1/2", r"\boxed{\frac12}"),
    (r"2\sqrt{3}", r"\boxed{2 \sqrt3}"),
    ("50%", r"\boxed{50\%}"),
    ("$12$", r"\boxed{12}"),
    (r"60^\circ", r"\boxed{60}"),
    ("Paris.", "The answer is Paris."),
    ("Paris", r"\boxed{\text{Paris.}}"),
])
def test_exact_reward_follows_verl_math_conventions(truth, response):
    """The answers verl's math reward counts as right (`strip_string`): exact must not mark them wrong."""
    assert reward(Stub("exact", truth), response) == 1.0
    assert reward(Stub("exact", truth), r"\boxed{7}") == 0.0
    assert reward(Stub("exact", "12 cm"), r"\boxed{12 \text{ m}}") == 0.0  # a number, but in other units


def test_boxed_choice_wins_and_letters_past_j():
    """A boxed letter is the answer as it is for every other kind, and a true letter past J can be scored."""
    assert reward(Stub("choice", "B"), r"The answer is (A). No: \boxed{B}") == 1.0
    assert reward(Stub("choice", "B"), r"\boxed{B} since D is wrong") == 1.0
    assert reward(Stub("choice", "B"), r"\boxed{\text{(B)}}") == 1.0
    assert reward(Stub("choice", "A"), r"\boxed{B}") == 0.0
    assert reward(Stub("choice", "K"), r"\boxed{K}") == 1.0 and reward(Stub("choice", "K"), "The answer is (K).") == 1.0
    assert extract_choice(r"\boxed{Because}") is None


def test_boxed_boxes_win_for_grounding():
    """A boxed answer wins for grounding too: the boxes written before it (or after a later "answer is") are not
    the prediction (they were: soft F1 2/3 and 0.12 below, for the right box boxed)."""
    truth = "[[1, 2, 10, 12]]"
    first_thought = r"At first I thought [0, 0, 5, 5], but it is \boxed{[[1, 2, 10, 12]]}"
    assert reward(Stub("grounding", truth), first_thought) == 1.0
    assert reward(Stub("grounding", truth), r"\boxed{[1, 2, 10, 12]} The answer is [[0, 0, 5, 5]].") == 1.0
    assert extract_boxes(r"\boxed{none} The answer is [[0, 0, 5, 5]].") == [[0.0, 0.0, 5.0, 5.0]]  # no box boxed
