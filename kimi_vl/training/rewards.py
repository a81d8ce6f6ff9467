"""Verifiable rewards for RL: answer extraction and one scorer per kind of sample (`sample.reward`).

Every reward lies in [0, 1]; higher is better. `reward(sample, response)` dispatches on `sample.reward`:

| kind        | scorer             | value                                                                       |
|-------------|--------------------|-----------------------------------------------------------------------------|
| "choice"    | `choice_reward`    | 1 if the extracted letter equals `sample.answer` (case-insensitive), else 0 |
| "number"    | `number_reward`    | 1 if the extracted number is within tolerance of `sample.answer`, else 0    |
| "count"     | `count_reward`     | `max(0, 1 - abs(pred - true) / max(abs(true), 1))`; 0 without a number      |
| "ocr"       | `ocr_reward`       | `1 - levenshtein(pred, true) / max(len(pred), len(true))`, normalised texts |
| "exact"     | `exact_reward`     | 1 if the extracted answer equals `sample.answer` after `normalise_text`     |
| "grounding" | `grounding_reward` | soft F1 of predicted vs true boxes under the optimal one-to-one IoU match   |
| "html"      | `html_reward`      | mean of the tag-sequence similarity and the text-token F1 of the two pages  |

Answer extraction (`extract_*`) follows the formats the synthetic world's target responses use, e.g.
`"... The answer is (B)."`, `"... The answer is 7."`, `"The answer is [[1, 2, 30, 40]]."`: the text after the
**last** "answer is" wins (a model may restate intermediate answers), and a `\\boxed{...}` (the convention of math
prompts such as verl's) wins over it; without either, each extractor falls back to a format-specific rule
(MMLU-Pro's `Answer: X` and last standalone letter for choices, the last number for numbers, the whole response for
OCR, every box in the response for grounding). A boxed answer is read with the conventions of verl's math
reward (`normalise_math`): `$`, `\\left`/`\\right`, `\\dfrac`/`\\tfrac`, degrees, percent signs, `\\text{...}` units
and a trailing period do not count, so `\\boxed{\\dfrac{1}{2}}`, `\\boxed{1/2}` and `\\boxed{0.5}` all answer
`\\frac{1}{2}` (exact) or 0.5 (number), while `\\boxed{2\\sqrt{3}}` or `\\boxed{10^{3}}` is no number at all (not its
first number, 2 or 10).

Only attributes of `sample` are read (`reward`, `answer`, `choices`, `meta`), so any object with those attributes
works (`kimi_vl.data.world.Sample` in practice).

The token budget (`token_budget`) implements the budget-control part of K2.5's reward: beyond `max_tokens` the
reward is zeroed (or, with `soft=True`, scaled down linearly to 0 at twice the budget).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from difflib import SequenceMatcher
from html.parser import HTMLParser
from typing import Any

from ..edit_distance import levenshtein
from ..errors import ConfigError
from ..vision.media import short_source

REWARD_KINDS: tuple[str, ...] = ("choice", "number", "count", "ocr", "exact", "grounding", "html")
"""The values of `sample.reward` that `reward` understands."""

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

_ANSWER_IS = re.compile(r"answer is\s*[:：]?\s*", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|(?<![\w.])[-+−]?\.\d+")
_BOX = re.compile(r"\[\s*([^\[\]]+?)\s*\]")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_MATH_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:e[-+]?\d+)?|\.\d+(?:e[-+]?\d+)?"
_MATH_VALUE = re.compile(
    rf"(?:[a-z]\w{{0,2}}\s*=\s*)?(?P<sign>[-+]?)\s*(?:\\frac\{{(?P<fn>{_MATH_NUMBER})\}}\{{(?P<fd>{_MATH_NUMBER})\}}"
    rf"|(?P<sn>{_MATH_NUMBER})\s*/\s*(?P<sd>{_MATH_NUMBER})|(?P<n>{_MATH_NUMBER}))"
    r"(?P<unit>\s+[a-z]+(?:\s+[a-z]+)*(?:\^\{?\d\}?)?)?"  # units after a space: "12 cm", "12 cm^2", "5 square units"
)


# ----------------------------------------------------------------------------------------------------------- extraction
def _after_last_answer_is(text: str) -> str | None:
    """The text after the last "answer is" (case-insensitive, optional colon), or None without that phrase."""
    last = None
    for match in _ANSWER_IS.finditer(text):
        last = match
    return None if last is None else text[last.end():]


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j].strip()
    return None


def normalise_math(text: str) -> str:
    """A math answer in a canonical form, after verl's math reward (`strip_string`): `$`, `\\(`, `\\[` and spacing
    commands removed; `\\dfrac` / `\\tfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`;
    `\\left` / `\\right`, degree signs and percent signs removed; `\\text{...}` (and `\\mathrm`, `\\mbox`, ...)
    replaced by its content after a space; `{,}` -> `,`; then `normalise_text` and one trailing period removed."""
    s = str(text).replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", " ", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s).replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\[,;:! ]|\\q?quad\b|~", " ", s).replace("{,}", ",").replace("−", "-")
    previous = None
    while previous != s:
        previous, s = s, _TEXT_WRAPPER.sub(r" \1", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)
    s = normalise_text(s)
    return s[:-1].rstrip() if s.endswith(".") else s


def math_value(text: str, *, units: bool = True) -> float | None:
    """The value of an answer that is one number after `normalise_math`: `12`, `-3.5`, `1,000`, `1e3`, `\\frac{1}{2}`,
    `1/2`, optionally after `x =` and (with `units`) before units (`12 cm`, `12\\text{ cm}^2`); degrees and percent
    signs never count (`60^\\circ`, `50\\%`). None for anything else (`2\\sqrt{3}`, `10^{3}`, `x = 1, y = 2`, a
    word)."""
    match = _MATH_VALUE.fullmatch(normalise_math(text))
    if match is None or (match["unit"] and not units):
        return None
    if match["n"] is not None:
        value = _to_float(match["n"])
    else:
        num, den = (_to_float(match["fn"]), _to_float(match["fd"])) if match["fn"] is not None else (
            _to_float(match["sn"]), _to_float(match["sd"]))
        value = None if num is None or not den else num / den
    if value is None or not math.isfinite(value):
        return None
    return -value if match["sign"] == "-" else value


def extract_answer(response: str) -> str:
    """The final answer as text: the content of the last `\\boxed{...}` when there is one; else what follows the last
    "answer is" (case-insensitive) up to the end of its line, without one trailing period, the parentheses of a
    single letter `(B)` and one pair of surrounding quotes; the whole stripped response when neither is there."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    tail = _after_last_answer_is(response)
    if tail is None:
        return response.strip()
    line = tail.strip().split("\n", 1)[0].strip()
    if line.endswith("."):
        line = line[:-1].rstrip()
    line = re.sub(r"^\(([A-Za-z])\)$", r"\1", line)
    if len(line) >= 2 and line[0] == line[-1] and line[0] in "\"'`":
        line = line[1:-1]
    return line.strip()


def extract_choice(response: str, num_choices: int | None = None) -> str | None:
    """The chosen option letter (upper case) or None.

    Rules, first hit wins (MMLU-Pro's three levels, taking the last match as its 2025 `apiX` script does; letters
    are case-sensitive), after a `\\boxed{...}` answer, which wins as for every extractor:
    0. the last `\\boxed{X}` (either case; also `\\boxed{(X)}`, `\\boxed{\\text{X}}`, `\\boxed{X. the option's text}`);
    1. the last `answer is (X)` / `answer is X` not followed by another letter (so "answer is Because" is no B);
    2. the last `Answer: X`;
    3. the last standalone capital letter.
    Letters are limited to the first `num_choices` (default A-J, MMLU-Pro's ten options).
    """
    n = 10 if num_choices is None else max(1, min(int(num_choices), len(LETTERS)))
    allowed = LETTERS[:n]
    cls = f"[{allowed}]"
    patterns = (
        rf"answer is\s*[:：]?\s*\(?({cls})\)?(?![A-Za-z])",
        rf"[aA]nswer:\s*\(?({cls})\)?(?![A-Za-z])",
        rf"\b({cls})\b",
    )
    boxed = last_boxed(response)
    if boxed and (letter := re.match(rf"\(?({cls})(?:\)|[.:]|\s|$)", normalise_math(boxed).upper())):
        return letter.group(1)
    for pattern in patterns:
        found = re.findall(pattern, response)
        if found:
            return found[-1]
    return None


def _to_float(token: str) -> float | None:
    token = token.replace(",", "").replace("−", "-")
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_numbers(text: str) -> list[float]:
    """Every number written in `text`, in order (`1,234` is one number; `3.5`, `-2`, `1e3`, `.5` are numbers)."""
    values = (_to_float(m.group(0)) for m in _NUMBER.finditer(text))
    return [v for v in values if v is not None]


def extract_number(response: str) -> float | None:
    """The answer as a number: the value of the last non-empty `\\boxed{...}` (`math_value`: None when what is boxed
    is not one number, e.g. `2\\sqrt{3}`), else the first number after the last "answer is", else the last number of
    the response; None when there is none."""
    boxed = last_boxed(response)
    if boxed:
        return math_value(boxed)
    tail = _after_last_answer_is(response)
    if tail is not None:
        numbers = parse_numbers(tail)
        if numbers:
            return numbers[0]
    numbers = parse_numbers(response)
    return numbers[-1] if numbers else None


def parse_boxes(text: str) -> list[list[float]]:
    """Every `[x0, y0, x1, y1]` (four numbers inside one pair of brackets) in `text`, in order."""
    boxes = []
    for match in _BOX.finditer(text):
        parts = [_to_float(part.strip()) for part in match.group(1).split(",")]
        if len(parts) == 4 and all(v is not None for v in parts):
            boxes.append(parts)
    return boxes


def true_boxes(answer: str) -> list[list[float]]:
    """The boxes of a ground-truth answer `"[[x0, y0, x1, y1], ...]"`, strictly: every bracketed group must be four
    finite numbers and there must be at least one (`ConfigError` otherwise; `parse_boxes`, for replies, skips what is
    not a box)."""
    groups = [match.group(1) for match in _BOX.finditer(str(answer))]
    if not groups:
        raise ConfigError(f"the true answer {short_source(answer)!r} holds no box; a grounding sample needs "
                          "[[x0, y0, x1, y1], ...].")
    boxes = []
    for group in groups:
        parts = [_to_float(part.strip()) for part in group.split(",")]
        if len(parts) != 4 or any(v is None for v in parts):
            raise ConfigError(f"the true answer {short_source(answer)!r} has the box [{group}], which is not four "
                              "numbers; write every box as [x0, y0, x1, y1].")
        boxes.append(parts)
    return boxes


def extract_boxes(response: str) -> list[list[float]]:
    """Predicted boxes: those in the last `\\boxed{...}` when it holds any, else those after the last "answer is"
    when there are any there, else every box in the response."""
    boxed = last_boxed(response)
    if boxed and (boxes := parse_boxes(boxed)):
        return boxes
    tail = _after_last_answer_is(response)
    if tail is not None:
        boxes = parse_boxes(tail)
        if boxes:
            return boxes
    return parse_boxes(response)


def extract_html(response: str) -> str:
    """The HTML of a response: the body of the last ``` fenced block when there is one, else the span from the first
    `<` to the last `>` (empty when there is no tag)."""
    fences = re.findall(r"```[a-zA-Z]*\n?(.*?)```", response, re.DOTALL)
    if fences:
        return fences[-1].strip()
    start, end = response.find("<"), response.rfind(">")
    return response[start : end + 1] if 0 <= start < end else ""


# ----------------------------------------------------------------------------------------------------------- scorers
def choice_reward(response: str, answer: str, num_choices: int | None = None) -> float:
    """1.0 when the extracted option letter equals `answer` (a letter, case-insensitive), else 0.0."""
    predicted = extract_choice(response, num_choices)
    return float(predicted is not None and predicted == answer.strip().strip("()").upper())


def number_reward(response: str, answer: str | float, *, rel_tol: float | None = None, abs_tol: float = 1e-6,
                  precision: int | None = None) -> float:
    """1.0 when the extracted number `p` and the true value `t` satisfy `|p - t| <= max(rel_tol * |t|, abs_tol)`,
    else 0.0. `rel_tol` defaults to 1e-4 for a true value with a fraction and to 0 for an integer one, which then
    needs the integer itself (10001 is no answer to 10000, nor 1000001 to 1000000). With `precision` (decimal places
    of the true answer, MathVista's field) the absolute tolerance becomes half a unit of the last place,
    `0.5 * 10**-precision`, so `3.46` counts for a true `3.5` at precision 1.
    A true answer that holds no number raises `ConfigError`."""
    truth = true_number(answer)
    predicted = extract_number(response)
    if predicted is None:
        return 0.0
    if rel_tol is None:
        rel_tol = 0.0 if precision is None and float(truth).is_integer() else 1e-4
    if precision is not None:
        abs_tol = max(abs_tol, 0.5 * 10.0 ** (-int(precision)) + 1e-12)
    return float(abs(predicted - truth) <= max(rel_tol * abs(truth), abs_tol))


def count_reward(response: str, answer: str | float) -> float:
    """Closeness of a count: `max(0, 1 - |pred - true| / max(|true|, 1))`, 0.0 when no number is given.

    Example: true 4 -> pred 4: 1.0, pred 3 or 5: 0.75, pred 8 or more: 0.0; true 0 -> pred 1: 0.0.
    """
    truth = true_number(answer)
    predicted = extract_number(response)
    if predicted is None:
        return 0.0
    return max(0.0, 1.0 - abs(predicted - truth) / max(abs(truth), 1.0))


def normalise_text(text: str) -> str:
    """OCR normalisation: Unicode case folding, every run of whitespace replaced by one space, ends stripped."""
    return " ".join(text.casefold().split())


def ocr_reward(response: str, answer: str) -> float:
    """`1 - levenshtein(p, t) / max(len(p), len(t))` over the normalised (`normalise_text`) extracted answer `p` and
    true text `t`; 1.0 when both are empty. Example: "HELLO" vs "helo" -> 1 - 1/5 = 0.8."""
    predicted = normalise_text(extract_answer(response))
    truth = normalise_text(answer)
    longest = max(len(predicted), len(truth))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(predicted, truth) / longest


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two `[x0, y0, x1, y1]` boxes (corners in either order; a degenerate box has area 0
    and IoU 0 with everything)."""
    ax0, ax1 = sorted((a[0], a[2]))
    ay0, ay1 = sorted((a[1], a[3]))
    bx0, bx1 = sorted((b[0], b[2]))
    by0, by1 = sorted((b[1], b[3]))
    iw = max(0.0, min(ax1, bx1) - max(ax0, bx0))
    ih = max(0.0, min(ay1, by1) - max(ay0, by0))
    inter = iw * ih
    union = (ax1 - ax0) * (ay1 - ay0) + (bx1 - bx0) * (by1 - by0) - inter
    return inter / union if union > 0 else 0.0


def max_weight_matching(weights: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """One-to-one matching of rows to columns maximising the summed weight (Hungarian algorithm with potentials,
    O(n^2 m)); returns the matched `(row, column)` pairs, `min(rows, columns)` of them."""
    rows = len(weights)
    cols = len(weights[0]) if rows else 0
    if rows == 0 or cols == 0:
        return []
    transposed = rows > cols
    cost = [[-float(w) for w in row] for row in weights]
    if transposed:
        cost = [list(col) for col in zip(*cost)]
        rows, cols = cols, rows
    # rows <= cols: assign every row. Potentials u (rows), v (cols); column 0 is a virtual start.
    u = [0.0] * (rows + 1)
    v = [0.0] * (cols + 1)
    owner = [0] * (cols + 1)  # owner[j]: 1-based row assigned to column j (0 = free)
    way = [0] * (cols + 1)
    for i in range(1, rows + 1):
        owner[0] = i
        j0 = 0
        slack = [math.inf] * (cols + 1)
        used = [False] * (cols + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = owner[j0], math.inf, 0
            for j in range(1, cols + 1):
                if not used[j]:
                    reduced = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if reduced < slack[j]:
                        slack[j], way[j] = reduced, j0
                    if slack[j] < delta:
                        delta, j1 = slack[j], j
            for j in range(cols + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            j0 = j1
            if owner[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    pairs = [(owner[j] - 1, j - 1) for j in range(1, cols + 1) if owner[j]]
    if transposed:
        pairs = [(c, r) for r, c in pairs]
    return sorted(pairs)


def soft_f1(predicted: Sequence[Sequence[float]], truth: Sequence[Sequence[float]]) -> float:
    """Soft F1 of two box sets (K2.5's grounding reward): match predicted and true boxes one-to-one maximising the
    summed IoU; with `S` that sum, precision `S / len(predicted)`, recall `S / len(truth)`, F1 their harmonic mean.
    Both empty -> 1.0; exactly one empty -> 0.0. Example: one true box, two predictions, the best with IoU 0.5:
    P = 0.25, R = 0.5, F1 = 1/3."""
    if not predicted and not truth:
        return 1.0
    if not predicted or not truth:
        return 0.0
    ious = [[box_iou(p, t) for t in truth] for p in predicted]
    matched = sum(ious[r][c] for r, c in max_weight_matching(ious))
    if matched <= 0:
        return 0.0
    precision, recall = matched / len(predicted), matched / len(truth)
    return 2 * precision * recall / (precision + recall)


def grounding_reward(response: str, boxes: Sequence[Sequence[float]] | str) -> float:
    """`soft_f1` of the boxes extracted from `response` (`extract_boxes`) against the true `boxes` (a list of
    `[x0, y0, x1, y1]` or the answer string `"[[x0, y0, x1, y1], ...]"`, read by `true_boxes`: a malformed box
    raises `ConfigError`)."""
    truth = true_boxes(boxes) if isinstance(boxes, str) else [list(map(float, b)) for b in boxes]
    return soft_f1(extract_boxes(response), truth)


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.words: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)

    def handle_endtag(self, tag: str) -> None:
        self.tags.append("/" + tag)

    def handle_data(self, data: str) -> None:
        self.words.extend(data.casefold().split())


def html_structure(html: str) -> tuple[list[str], list[str]]:
    """`(tags, words)` of an HTML string: the sequence of start (`div`) and end (`/div`) tags, and the case-folded
    whitespace-separated words of its text content (attributes are ignored)."""
    parser = _PageParser()
    try:
        parser.feed(html)
        parser.close()
    except Exception:  # html.parser is lenient; anything it still rejects counts as what was read so far
        pass
    return parser.tags, parser.words


def token_f1(predicted: Sequence[str], truth: Sequence[str]) -> float:
    """F1 of two token multisets (both empty -> 1.0)."""
    if not predicted and not truth:
        return 1.0
    common = sum((Counter(predicted) & Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def html_reward(response: str, html: str) -> float:
    """Cheap structural similarity of the response's HTML (`extract_html`) to the true `html`, in [0, 1]:
    `0.5 * tag_similarity + 0.5 * text_f1`, where `tag_similarity` is difflib's `SequenceMatcher.ratio` of the two
    tag sequences (start and end tags in document order: rewards the same elements in the same nesting) and `text_f1`
    is `token_f1` of the case-folded words of the visible text. A response without any tag scores 0; an identical
    page scores 1. It does not render the page: layout and styling beyond the tags are not compared."""
    page = extract_html(response)
    if not page:
        return 0.0
    pred_tags, pred_words = html_structure(page)
    true_tags, true_words = html_structure(html)
    if not pred_tags:
        return 0.0
    tags = SequenceMatcher(None, pred_tags, true_tags, autojunk=False).ratio() if true_tags else 0.0
    return 0.5 * tags + 0.5 * token_f1(pred_words, true_words)


def exact_reward(response: str, answer: str) -> float:
    """1.0 when the extracted answer (`extract_answer`) equals `answer` after `normalise_text`, or after
    `normalise_math` with spaces removed (verl's convention: `\\dfrac{1}{2}` = `\\frac12`, `50\\%` = `50%`,
    `Paris.` = `Paris`), or when both are one number without units (`math_value`) of the same value (`0.5` = `1/2` =
    `\\frac{1}{2}`; `12 m` is not `12 cm`); else 0.0."""
    predicted, truth = extract_answer(response), str(answer)
    if normalise_text(predicted) == normalise_text(truth):
        return 1.0
    if normalise_math(predicted).replace(" ", "") == normalise_math(truth).replace(" ", ""):
        return 1.0
    p, t = math_value(predicted, units=False), math_value(truth, units=False)
    return float(p is not None and t is not None and math.isclose(p, t, rel_tol=1e-9, abs_tol=1e-12))


def format_reward(response: str, kind: str) -> float:
    """1.0 when `response` holds an answer in the format of `kind` (a `REWARD_KINDS` value), else 0.0:
    choice -> an option letter can be extracted; number / count -> a number; ocr / exact -> a `\\boxed{}` or an "answer
    is" phrase followed by text; grounding -> at least one box; html -> at least one tag."""
    _check_kind(kind)
    if kind == "choice":
        return float(extract_choice(response) is not None)
    if kind in ("number", "count"):
        return float(extract_number(response) is not None)
    if kind in ("ocr", "exact"):
        tail = last_boxed(response)
        tail = _after_last_answer_is(response) if tail is None else tail
        return float(tail is not None and bool(tail.strip().strip(".")))
    if kind == "grounding":
        return float(bool(extract_boxes(response)))
    return float(bool(html_structure(extract_html(response))[0]))


def token_budget(value: float, num_tokens: int, max_tokens: int, *, soft: bool = False) -> float:
    """Budget control: `value` unchanged within `max_tokens` generated tokens; beyond it 0 (`soft=False`, K2.5's
    Toggle phase-0 rule `r * 1{|y| <= budget}`) or `value * max(0, 1 - (num_tokens - max_tokens) / max_tokens)`
    (`soft=True`: linear down to 0 at twice the budget)."""
    if max_tokens <= 0:
        raise ConfigError(f"max_tokens must be positive, got {max_tokens}; pass the token budget of a response.")
    if num_tokens <= max_tokens:
        return value
    if not soft:
        return 0.0
    return value * max(0.0, 1.0 - (num_tokens - max_tokens) / max_tokens)


# ----------------------------------------------------------------------------------------------------------- dispatch
def _check_kind(kind: str) -> None:
    if kind not in REWARD_KINDS:
        raise ConfigError(
            f"unknown reward kind {kind!r}; sample.reward must be one of {', '.join(REWARD_KINDS)} "
            "(add a scorer to kimi_vl.training.rewards for a new kind)."
        )


def true_number(answer: str | float) -> float:
    """The true value of a number/count sample: `answer` itself when it is a finite number, else its value when it is
    one number (`math_value`: `\\frac{1}{2}`, `1/2`, `12 cm`), else the first number written in it (`parse_numbers`).
    `ConfigError` when there is none (an infinite value such as `1e400` is none)."""
    if isinstance(answer, (int, float)):
        if not math.isfinite(answer):
            raise ConfigError(f"the true answer {answer!r} is not a finite number; a number/count sample needs one.")
        return float(answer)
    value = math_value(str(answer))
    if value is not None:
        return value
    written = [m.group(0) for m in _NUMBER.finditer(str(answer))]
    numbers = [v for v in map(_to_float, written) if v is not None]
    if not numbers:
        what = (f"holds no finite number ({written[0]} is out of a float's range)" if written else
                "holds no number")
        raise ConfigError(f"the true answer {short_source(answer)!r} {what}; a number/count sample needs a numeric "
                          "answer.")
    return numbers[0]


def reward(sample: Any, response: str, *, max_tokens: int | None = None, num_tokens: int | None = None,
           soft_budget: bool = False) -> float:
    """The verifiable reward in [0, 1] of `response` (the decoded assistant reply) to `sample`.

    Dispatches on `sample.reward` (see the module table). Reads `sample.answer`, and where relevant
    `sample.choices` (number of option letters), `sample.meta["precision"]` (number tolerance),
    `sample.meta["boxes"]` (grounding truth; else parsed from `sample.answer`). With both `max_tokens` and
    `num_tokens` (the response's generated-token count) the result goes through `token_budget`.

    Raises:
        ConfigError: an unknown `sample.reward`, a number/count sample whose answer holds no number, a grounding
            sample whose answer string has a malformed box (`true_boxes`), or only one of
            `max_tokens` / `num_tokens`.
    """
    kind = sample.reward
    _check_kind(kind)
    meta = getattr(sample, "meta", None) or {}
    answer = sample.answer
    if kind == "choice":
        choices = getattr(sample, "choices", None)
        letter = str(answer).strip().strip("()").upper()
        # without choices, letters up to the true one count (A-J at least, MMLU-Pro's ten): a "K" must be readable
        n = len(choices) if choices else max(10, LETTERS.find(letter) + 1 if len(letter) == 1 else 0)
        value = choice_reward(response, answer, n)
    elif kind == "number":
        value = number_reward(response, answer, precision=meta.get("precision"))
    elif kind == "count":
        value = count_reward(response, answer)
    elif kind == "ocr":
        value = ocr_reward(response, answer)
    elif kind == "exact":
        value = exact_reward(response, answer)
    elif kind == "grounding":
        value = grounding_reward(response, meta["boxes"] if meta.get("boxes") is not None else answer)
    else:
        value = html_reward(response, answer)
    if (max_tokens is None) != (num_tokens is None):
        raise ConfigError("pass both max_tokens (the budget) and num_tokens (the response's length), or neither.")
    if max_tokens is not None:
        value = token_budget(value, int(num_tokens), int(max_tokens), soft=soft_budget)
    return float(value)


__all__ = [
    "REWARD_KINDS",
    "box_iou",
    "choice_reward",
    "count_reward",
    "exact_reward",
    "extract_answer",
    "extract_boxes",
    "extract_choice",
    "extract_html",
    "extract_number",
    "format_reward",
    "grounding_reward",
    "html_reward",
    "html_structure",
    "last_boxed",
    "levenshtein",
    "math_value",
    "max_weight_matching",
    "normalise_math",
    "normalise_text",
    "number_reward",
    "ocr_reward",
    "parse_boxes",
    "parse_numbers",
    "reward",
    "soft_f1",
    "token_budget",
    "token_f1",
    "true_boxes",
    "true_number",
]
