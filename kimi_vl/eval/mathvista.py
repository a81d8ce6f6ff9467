"""MathVista testmini with the official protocol (lupantech/MathVista, `evaluation/`).

Reproduced from the official repository (lupantech/MathVista @ 53d52587: `evaluation/build_query.py`,
`extract_answer.py`, `calculate_score.py`):

- Data: `AI4Math/MathVista` split `testmini` (1,000 problems with answers; `answer` is a string, the choice
  *text* for multiple choice), or a local copy (`data/testmini.json` of the official repository, parquet or
  JSONL in the same schema) with the images under `images/<pid>.jpg`.
- Query (`build_query`): the dataset's `query` field when present, else the official zero-shot construction
  (`data/query.json`): `Hint: ...` (by question / answer type and precision), `Question: ...` (with
  ` (Unit: u)` when there is a unit) and, for multiple choice, `Choices:` then `(A) c0`, `(B) c1`, ... one per
  line.
- Extraction (`extract_answer`): an empty response gives `""`; a multiple-choice response equal to a choice is
  kept; an integer (float) question whose whole response parses with Python's `int()` (`float()`) gives its
  `str`; with `quick_extract` the group of `The answer is "(.*)"\\.`; otherwise the LLM extractor is asked with
  `DEMO_PROMPT` + the query + the response (`build_extraction_prompt`). The official extractor is an OpenAI GPT
  model; here any local model can be plugged in (`llm=` a callable prompt -> text), and without one a rule-based
  `heuristic_extract` (not official) stands in. Which one was used is part of every report.
- Normalisation and scoring (`normalize_extracted_answer`, `is_correct`): multiple choice -> the first `(x)`
  letter if any, a valid option letter -> its choice text, anything else -> the choice nearest by Levenshtein
  distance (first minimum); integer -> `str(int(float(x)))`; float -> `str(round(float(x), int(precision)))`;
  list -> `str(x)`; unparseable -> None; then plain `==` with the answer string.
- Scores (`compute_scores`): overall accuracy plus per value of question_type, answer_type, language, source,
  category, task, context, grade and skills (a problem counts in each of its skills), each sorted by accuracy
  (descending, stable). Format of the official `scores_*.json`: the overall `accuracy` is
  `str(round(100 * correct / total, 2))` (e.g. `"26.1"`), the others `"{:.2f}"` of the percentage.
  The official script lists skills in `set()` order, which varies between Python processes; here every key lists
  its values in order of first appearance before the stable sort (the same order as the official one for all
  other keys).
"""

from __future__ import annotations

import io
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..edit_distance import levenshtein
from ..errors import BadRecordError, ConfigError, InvalidMediaError
from .data import check_rows, load_hub_dataset, load_local_split, require_rows

if TYPE_CHECKING:
    from PIL import Image

HF_REPO = "AI4Math/MathVista"
SPLIT = "testmini"
BENCHMARK_DIRS = ("mathvista", "MathVista")
MAX_NEW_TOKENS = 1024

HINT_MULTI_CHOICE = "Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
HINT_INTEGER = (
    "Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end."
)
HINT_FLOAT_1 = (
    "Please answer the question requiring a floating-point number with one decimal place and provide the final "
    "value, e.g., 1.2, 1.3, 1.4, at the end."
)
HINT_FLOAT_2 = (
    "Please answer the question requiring a floating-point number with two decimal places and provide the final "
    "value, e.g., 1.23, 1.34, 1.45, at the end."
)
HINT_LIST = (
    "Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], "
    "[1.2, 1.3, 1.4], at the end."
)

DEMO_PROMPT = """
Please read the following example. Then extract the answer from the model response and type it at the end of the \
prompt.

Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.
Question: Which number is missing?

Model response: The number missing in the sequence is 14.

Extracted answer: 14

Hint: Please answer the question requiring a floating-point number with one decimal place and provide the final \
value, e.g., 1.2, 1.3, 1.4, at the end.
Question: What is the fraction of females facing the camera?

Model response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the \
group are facing the camera.

Extracted answer: 0.6

Hint: Please answer the question requiring a floating-point number with two decimal places and provide the final \
value, e.g., 1.23, 1.34, 1.45, at the end.
Question: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)

Model response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.

Extracted answer: 1.45

Hint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], \
[1.2, 1.3, 1.4], at the end.
Question: Between which two years does the line  graph saw its maximum peak?

Model response: The line graph saw its maximum peak between 2007 and 2008.

Extracted answer: [2007, 2008]

Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.
Question: What fraction of the shape is blue?
Choices:
(A) 3/11
(B) 8/11
(C) 6/11
(D) 3/5

Model response: The correct answer is (B) 8/11.

Extracted answer: B
"""
"""The official in-context demonstrations of the answer extractor (`evaluation/prompts/ext_ans.py`; its
"line  graph" double space included)."""

SCORE_KEYS: tuple[str, ...] = (
    "question_type", "answer_type", "language", "source", "category", "task", "context", "grade", "skills",
)
"""The breakdowns of the official scores file, in its order."""

TASK_ABBREVIATIONS = {
    "figure question answering": "FQA",
    "geometry problem solving": "GPS",
    "math word problem": "MWP",
    "textbook question answering": "TQA",
    "visual question answering": "VQA",
}
SKILL_ABBREVIATIONS = {
    "algebraic reasoning": "ALG",
    "arithmetic reasoning": "ARI",
    "geometry reasoning": "GEO",
    "logical reasoning": "LOG",
    "numeric commonsense": "NUM",
    "scientific reasoning": "SCI",
    "statistical reasoning": "STA",
}
"""Leaderboard column names (ALL, FQA, GPS, MWP, TQA, VQA, ALG, ARI, GEO, LOG, NUM, SCI, STA)."""

_QUICK_PATTERN = re.compile(r'The answer is "(.*)"\.')


# ------------------------------------------------------------------------------------------------------- queries
def build_query(problem: Mapping[str, Any]) -> str:
    """The official zero-shot query of a problem (the `query` field of the dataset): hint, question (+ unit),
    choices, one element per line, the whole stripped of surrounding whitespace (as officially).

    Raises:
        ConfigError: a question / answer type the official hints do not cover (e.g. a float with precision 3).
    """
    qtype, atype, precision = problem["question_type"], problem["answer_type"], problem.get("precision")
    if qtype == "multi_choice":
        hint = HINT_MULTI_CHOICE
    elif atype == "integer":
        hint = HINT_INTEGER
    elif atype == "float" and precision == 1:
        hint = HINT_FLOAT_1
    elif atype == "float" and precision == 2:
        hint = HINT_FLOAT_2
    elif atype == "list":
        hint = HINT_LIST
    else:
        raise ConfigError(
            f"problem {problem.get('pid')!r}: no official hint for question_type={qtype!r}, answer_type={atype!r}, "
            f"precision={precision!r}; MathVista has multi_choice, integer, float (precision 1 or 2) and list."
        )
    question = f"Question: {problem['question']}"
    if problem.get("unit"):
        question += f" (Unit: {problem['unit']})"
    elements = [f"Hint: {hint}", question]
    choices = problem.get("choices")
    if choices:
        elements.append("\n".join(["Choices:"] + [f"({chr(ord('A') + i)}) {c}" for i, c in enumerate(choices)]))
    return "\n".join(elements).strip()


def query_of(problem: Mapping[str, Any]) -> str:
    """The problem's `query` field when it has one, else `build_query(problem)`."""
    return problem.get("query") or build_query(problem)


# ---------------------------------------------------------------------------------------------------- extraction
def build_extraction_prompt(query: str, response: str) -> str:
    """The official LLM-extractor prompt: the demonstrations, the query, the response, `Extracted answer: `."""
    return f"{DEMO_PROMPT.strip()}\n\n{query}\n\n{response}\n\nExtracted answer: "


def rule_extract(response: str, problem: Mapping[str, Any], *, quick_extract: bool = True) -> str | None:
    """The official rule steps of the extractor; None when they do not decide (the LLM step comes next)."""
    if not response:
        return ""
    if problem["question_type"] == "multi_choice" and response in (problem.get("choices") or []):
        return response
    if problem["answer_type"] == "integer":
        try:
            return str(int(response))
        except (TypeError, ValueError):
            pass
    if problem["answer_type"] == "float":
        try:
            return str(float(response))
        except (TypeError, ValueError):
            pass
    if quick_extract:
        match = _QUICK_PATTERN.search(response)
        if match:
            return match.group(1)
    return None


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_ANSWER_NUMBER = re.compile(r"answer(?: is|:)\s*[:=]?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_LIST = re.compile(r"\[[^\[\]]*\]")


def heuristic_extract(response: str, problem: Mapping[str, Any]) -> str:
    """A rule-based stand-in for the LLM extractor (NOT part of the official protocol).

    Multiple choice: the letter after "answer is" / "answer:" (optionally in parentheses), else the last `(X)`,
    else a lone letter ending the response, else the choice text that occurs last in the response, else `""`.
    Integer / float: the number after "answer is" / "answer:", else the last number (thousands commas removed).
    List: the last `[...]`. Anything else: `""`.
    """
    text = response.strip()
    choices = list(problem.get("choices") or [])
    if problem["question_type"] == "multi_choice" and choices:
        letters = "".join(chr(ord("A") + i) for i in range(len(choices)))
        cls = f"[{letters}]"
        for pattern in (
            rf"(?i:answer is):?\s*\(?({cls})\)?(?![A-Za-z])",
            rf"(?i:answer):\s*\(?({cls})\)?(?![A-Za-z])",
        ):
            match = re.search(pattern, text)
            if match:
                return match.group(1)
        found = re.findall(rf"\(({cls})\)", text)
        if found:
            return found[-1]
        match = re.search(rf"(?<![A-Za-z])({cls})[.)]?\s*$", text)
        if match:
            return match.group(1)
        best, best_pos = "", -1
        for choice in choices:
            pos = text.rfind(str(choice)) if str(choice) else -1
            if pos > best_pos or (pos == best_pos and pos >= 0 and len(str(choice)) > len(best)):
                best, best_pos = str(choice), pos
        return best
    atype = problem["answer_type"]
    if atype in ("integer", "float"):
        match = _ANSWER_NUMBER.search(text)
        numbers = [match.group(1)] if match else _ANY_NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else ""
    if atype == "list":
        found = _LIST.findall(text)
        return found[-1] if found else ""
    return ""


def extract_answer(
    response: str,
    problem: Mapping[str, Any],
    *,
    quick_extract: bool = True,
    llm: Callable[[str], str] | None = None,
    heuristic: bool = True,
) -> str:
    """The extracted answer of `response` to `problem` (official steps, see the module docstring).

    Args:
        quick_extract: apply the official `The answer is "..."` rule before the LLM (the official
            `--quick_extract` flag).
        llm: the extractor model, `prompt -> text` (the official one is a GPT model); its output is stripped. An
            exception from it gives `""`, as officially.
        heuristic: without `llm`, use `heuristic_extract` (not official); with `heuristic=False` the rules alone
            decide and an undecided response gives `""`.
    """
    decided = rule_extract(response, problem, quick_extract=quick_extract)
    if decided is not None:
        return decided
    if llm is not None:
        try:
            return str(llm(build_extraction_prompt(query_of(problem), response))).strip()
        except Exception:  # the official extractor swallows any failure of the model call
            return ""
    return heuristic_extract(response, problem) if heuristic else ""


# ------------------------------------------------------------------------------------------------------- scoring
def most_similar_choice(prediction: str, choices: list) -> Any:
    """The choice with the smallest Levenshtein distance to `prediction` (the first one on ties)."""
    distances = [levenshtein(prediction, str(c)) for c in choices]
    return choices[distances.index(min(distances))]


def normalize_extracted_answer(
    extraction: Any, choices: list | None, question_type: str, answer_type: str, precision: Any
) -> str | None:
    """The official normalisation of an extraction to the answer's form (see the module docstring); None when a
    numeric extraction does not parse."""
    if question_type == "multi_choice":
        if isinstance(extraction, str):
            extraction = extraction.strip()
        else:
            try:
                extraction = str(extraction)
            except Exception:
                extraction = ""
        letters = re.findall(r"\(([a-zA-Z])\)", extraction)
        if letters:
            extraction = letters[0].upper()
        choices = list(choices or [])
        if not choices:
            raise ConfigError("a multi_choice problem without choices cannot be scored; check the data.")
        options = [chr(ord("A") + i) for i in range(len(choices))]
        if extraction in options:
            return choices[options.index(extraction)]
        return most_similar_choice(extraction, choices)
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision)))
        if answer_type == "list":
            return str(extraction)
    except (TypeError, ValueError, OverflowError):
        return None
    return extraction


def safe_equal(prediction: Any, answer: Any) -> bool:
    """`prediction == answer`, False when the comparison itself fails."""
    try:
        return bool(prediction == answer)
    except Exception:
        return False


def is_correct(problem: Mapping[str, Any], extraction: Any) -> bool:
    """Whether `extraction` (an extracted answer) is correct for the testmini row `problem`."""
    prediction = normalize_extracted_answer(
        extraction, problem.get("choices"), problem["question_type"], problem["answer_type"], problem.get("precision")
    )
    return safe_equal(prediction, problem["answer"])


def score_problem(problem: Mapping[str, Any], extraction: Any) -> dict[str, Any]:
    """`{"prediction", "true_false"}` of one problem, as the official scorer writes them."""
    prediction = normalize_extracted_answer(
        extraction, problem.get("choices"), problem["question_type"], problem["answer_type"], problem.get("precision")
    )
    return {"prediction": prediction, "true_false": safe_equal(prediction, problem["answer"])}


def flatten_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the problem `row` with the fields of its `metadata` (task, skills, category, ...) at the top level, as
    the official scorer reads them; a row that already has them there is copied as it is."""
    flat = dict(row)
    meta = flat.pop("metadata", None)
    if isinstance(meta, Mapping):
        flat.update(meta)
    return flat


def breakdown_values(flat: Mapping[str, Any], key: str) -> list[Any]:
    """The values under which a `flatten_metadata` row counts in the breakdown `key` of `SCORE_KEYS`: its `key`
    field, or for `skills` each listed skill once (like the official `value in skills`); none when missing."""
    value = flat.get(key)
    values = (value if isinstance(value, (list, tuple)) else []) if key == "skills" else [value]
    return [v for v in dict.fromkeys(values) if v is not None and not (isinstance(v, float) and v != v)]


def compute_scores(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The official scores structure of `{pid: row with true_false}` (rows with their `metadata`, or with its
    fields already at the top level).

    Returns `{"average": {"accuracy", "correct", "total"}, "<key>": {value: {"accuracy", "correct", "total"}}}`
    for the keys of `SCORE_KEYS`, accuracies as percentage strings (see the module docstring).
    """
    rows = [flatten_metadata(row) for row in results.values()]
    total = len(rows)
    correct = sum(1 for r in rows if r.get("true_false"))
    scores: dict[str, Any] = {
        "average": {"accuracy": str(round(correct / total * 100, 2)) if total else "0.0", "correct": correct,
                    "total": total}
    }
    for key in SCORE_KEYS:
        tallies: dict[Any, list[int]] = {}
        for r in rows:
            for v in breakdown_values(r, key):
                t = tallies.setdefault(v, [0, 0])
                t[0] += bool(r.get("true_false") == True)  # noqa: E712 - the official `== True`
                t[1] += 1
        per_value = {
            v: {"accuracy": f"{c / t * 100:.2f}", "correct": c, "total": t} for v, (c, t) in tallies.items()
        }
        scores[key] = dict(sorted(per_value.items(), key=lambda item: float(item[1]["accuracy"]), reverse=True))
    return scores


def baselines(problems: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What answering without reading gets on `problems`: `chance` (uniform guessing among the choices; free-form
    questions count 0) and `constant` (on multiple choice always the letter most often correct, on free form always
    the most frequent answer; `constant_answer` names them). The constant answers are scored like any extraction
    (`is_correct`), so the free-form `6` is also right on a float answer `6.0`, and a letter past a problem's choices
    is right where the choice nearest to it is."""
    rows = list(problems.values())
    if not rows:
        return {"chance": 0.0, "constant": 0.0, "constant_answer": "none"}
    mc = [p for p in rows if p["question_type"] == "multi_choice"]
    free = [p for p in rows if p["question_type"] != "multi_choice"]
    constants, described = [], []
    if mc:
        indices = Counter(list(p["choices"]).index(p["answer"]) for p in mc)
        letter = chr(ord("A") + min(indices.items(), key=lambda kv: (-kv[1], kv[0]))[0])
        constants += [(p, letter) for p in mc]
        described.append(f"({letter}) on multiple choice")
    if free:
        answer = min(Counter(str(p["answer"]) for p in free).items(), key=lambda kv: (-kv[1], kv[0]))[0]
        constants += [(p, answer) for p in free]
        described.append(f"{answer} on free form")
    return {"chance": sum(1 / len(p["choices"]) for p in mc) / len(rows),
            "constant": sum(is_correct(p, answer) for p, answer in constants) / len(rows),
            "constant_answer": ", ".join(described)}


def leaderboard(scores: Mapping[str, Any]) -> dict[str, float]:
    """The leaderboard columns (ALL, FQA, GPS, MWP, TQA, VQA, ALG, ARI, GEO, LOG, NUM, SCI, STA) as percentages,
    from a `compute_scores` result; columns without problems are left out."""
    out = {"ALL": float(scores["average"]["accuracy"])}
    for key, names in (("task", TASK_ABBREVIATIONS), ("skills", SKILL_ABBREVIATIONS)):
        for full, short in names.items():
            if full in scores.get(key, {}):
                out[short] = float(scores[key][full]["accuracy"])
    return out


# ---------------------------------------------------------------------------------------------------------- data
_LAYOUT_HINT = (
    "pass --data-dir DIR with MathVista testmini in the dataset's schema: DIR/mathvista/testmini.json (the official "
    "repository's data/testmini.json) or DIR/mathvista/testmini*.parquet|jsonl (from `huggingface-cli download "
    "AI4Math/MathVista --repo-type dataset`), and the images as DIR/mathvista/images/<pid>.jpg (images.zip of the "
    "dataset, unzipped) unless the rows carry `decoded_image`"
)


def load_mathvista(data_dir: str | os.PathLike | None = None, split: str = SPLIT) -> dict[str, dict[str, Any]]:
    """`{pid: row}` of MathVista `split`, from `data_dir` when given (rows get `_image_root` to find their
    images), else from the hub (rows carry `decoded_image`).

    Raises:
        DataUnavailableError: the hub is unreachable (pass `data_dir`), the local files are missing, or they hold
            no rows.
        BadRecordError (a DataError): a row without `pid` or `answer`, or two rows with one pid (the message
            names the file and the row).
    """
    if data_dir is not None:
        rows, files = load_local_split(data_dir, BENCHMARK_DIRS, split, check=_check_row, fix=_ROW_FIX)
        require_rows(rows, split, files, f"put the MathVista {split} problems there ({_LAYOUT_HINT}).")
        for r in rows:
            r.setdefault("_image_root", str(files[0].parent))
        source = ", ".join(str(f) for f in files)
    else:
        rows = list(load_hub_dataset(HF_REPO, split, hint=_LAYOUT_HINT))
        source = f"{HF_REPO} {split} split"
        check_rows(list(enumerate(rows, 1)), _check_row, source, _ROW_FIX)
        require_rows(rows, split, f"{HF_REPO} (hub)", f"{_LAYOUT_HINT}.")
    problems: dict[str, dict[str, Any]] = {}
    for number, r in enumerate(rows, 1):
        pid = str(r["pid"])
        if pid in problems:  # one would silently replace the other
            raise BadRecordError(f"pid {pid!r} is used by two problems; give each problem its own pid", source,
                                 number)
        problems[pid] = r
    return problems


_ROW_FIX = f"fix the row or remove it ({_LAYOUT_HINT})"


def _check_row(row: Mapping[str, Any]) -> str | None:
    missing = [f for f in ("pid", "answer") if f not in row]
    return f"the problem lacks {' and '.join(f'`{f}`' for f in missing)}" if missing else None


def resolve_image(problem: Mapping[str, Any], image_root: str | os.PathLike | None = None) -> Any:
    """Where the problem's image is: its `decoded_image` (PIL image or `{"bytes": ...}`) when present, else the
    path of the file `image` (e.g. `images/1.jpg`) under `image_root` / the row's `_image_root` (also tried as
    `images/<name>`).

    Raises:
        InvalidMediaError: no image found; the message says where it was looked for.
    """
    from PIL import Image

    decoded = problem.get("decoded_image")
    if isinstance(decoded, Image.Image) or (isinstance(decoded, Mapping) and decoded.get("bytes")):
        return decoded
    rel = problem.get("image")
    roots = [r for r in (image_root, problem.get("_image_root")) if r]
    tried: list[str] = []
    for root in roots:
        for candidate in (Path(root) / str(rel), Path(root) / "images" / Path(str(rel)).name):
            if rel and candidate.is_file():
                return candidate
            if str(candidate) not in tried:  # `images/<name>` gives the same path both ways: listed once
                tried.append(str(candidate))
    raise InvalidMediaError(
        f"no image for MathVista problem {problem.get('pid')} (image={rel!r}; looked at {tried or 'nothing'}): put "
        "the dataset's images (images.zip of AI4Math/MathVista, unzipped) next to the data file as images/<pid>.jpg."
    )


def load_problem_image(problem: Mapping[str, Any], image_root: str | os.PathLike | None = None) -> Image.Image:
    """The problem's image (see `resolve_image`) as an RGB PIL image.

    Raises:
        InvalidMediaError: no image found, or an unreadable one.
    """
    from PIL import Image

    from ..vision import load_image

    found = resolve_image(problem, image_root)
    if isinstance(found, Mapping):
        try:
            return load_image(Image.open(io.BytesIO(found["bytes"])))
        except OSError as exc:
            raise InvalidMediaError(
                f"problem {problem.get('pid')}: its decoded_image bytes are unreadable ({exc}); re-download the data."
            ) from exc
    return load_image(found)


def iter_ordered(problems: Mapping[str, Any], limit: int | None = None) -> Iterable[str]:
    """Pids in data order, the first `limit` of them when given."""
    pids = list(problems)
    if limit is not None:
        if limit < 0:
            raise ConfigError(f"limit must be >= 0, got {limit}.")
        pids = pids[:limit]
    return pids


__all__ = [
    "DEMO_PROMPT",
    "HF_REPO",
    "MAX_NEW_TOKENS",
    "SCORE_KEYS",
    "SKILL_ABBREVIATIONS",
    "TASK_ABBREVIATIONS",
    "breakdown_values",
    "build_extraction_prompt",
    "build_query",
    "compute_scores",
    "extract_answer",
    "flatten_metadata",
    "heuristic_extract",
    "is_correct",
    "iter_ordered",
    "leaderboard",
    "levenshtein",
    "load_mathvista",
    "load_problem_image",
    "most_similar_choice",
    "normalize_extracted_answer",
    "query_of",
    "resolve_image",
    "rule_extract",
    "safe_equal",
    "score_problem",
]
