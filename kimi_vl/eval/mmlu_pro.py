"""MMLU-Pro with the official 5-shot chain-of-thought protocol (TIGER-AI-Lab/MMLU-Pro, `evaluate_from_local.py`).

Protocol, reproduced from the official repository (TIGER-AI-Lab/MMLU-Pro @ f418b116: `evaluate_from_local.py`,
`compute_accuracy.py`), quirks included:

- Data: `TIGER-Lab/MMLU-Pro` splits `test` (12,032 questions) and `validation` (70 = 5 per category, with
  `cot_content`). Options equal to `"N/A"` (padding) are dropped.
- Prompt (a raw completion prompt, no chat template): the header `INITIAL_PROMPT` with `{$}` replaced by the
  category, plus one more newline (so the sentence is followed by four newlines); then the first `k` validation
  rows of the question's category, each as `Question:\\n{q}\\nOptions:\\nA. {o}\\n...` followed by its
  `cot_content` with `"A: Let's think step by step."` replaced by `"Answer: Let's think step by step."` and
  `"\\n\\n"`; then the question in the same form ending with `Answer: Let's think step by step.` (no newline).
  `k` starts at 5 and is decreased while the prompt has `max_model_length - max_new_tokens` tokens or more
  (4096 - 2048 officially).
- Generation: greedy, at most 2048 new tokens, stop at `"Question:"` (the stop string is not part of the
  response).
- Extraction (`extract_answer`): the first match of `answer is \\(?([A-J])\\)?`; else of
  `.*[aA]nswer:\\s*([A-J])`; else the last standalone capital letter A-J (`\\b[A-J]\\b(?!.*\\b[A-J]\\b)`, DOTALL);
  else None.
- Scoring (`score`): a question without a prediction gets a random guess `randint(0, len(options) - 1)` drawn
  right after `random.seed(12345)` - the official script re-seeds before *every* guess, so the guess depends only
  on the number of options (quirk, reproduced); it counts as correct iff it equals `answer_index`. Accuracy per
  category is correct / (correct + wrong); the overall accuracy is the micro average over all questions (the
  official script adds 1e-6 to the denominator; it is left out here, a difference below 1e-8 for 12,032 rows).
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from .data import check_rows, load_hub_dataset, load_local_split, require_rows

HF_REPO = "TIGER-Lab/MMLU-Pro"
BENCHMARK_DIRS = ("mmlu_pro", "MMLU-Pro", "mmlu-pro")

CATEGORIES: tuple[str, ...] = (
    "biology", "business", "chemistry", "computer science", "economics", "engineering", "health", "history", "law",
    "math", "other", "philosophy", "physics", "psychology",
)
"""The 14 categories (note the space in "computer science")."""

CHOICES = "ABCDEFGHIJKLMNOP"
"""Option letters, in order (the official list runs to P; MMLU-Pro has at most 10 options)."""

INITIAL_PROMPT = (
    "The following are multiple choice questions (with answers) about {$}. Think step by step and then finish your "
    'answer with "the answer is (X)" where X is the correct letter choice.\n\n\n'
)
"""`cot_prompt_lib/initial_prompt.txt` as the official script reads it (three trailing newlines; the script
appends a fourth)."""

COT_PREFIX_SHOT = "A: Let's think step by step."
COT_PREFIX = "Answer: Let's think step by step."
STOP = ("Question:",)
"""Stop strings of the official generation (vLLM `stop`)."""

NUM_SHOTS = 5
MAX_MODEL_LENGTH = 4096
MAX_NEW_TOKENS = 2048
RANDOM_SEED = 12345

PATTERNS: tuple[str, ...] = (
    r"answer is \(?([A-J])\)?",
    r".*[aA]nswer:\s*([A-J])",
    r"\b[A-J]\b(?!.*\b[A-J]\b)",
)
"""The official extraction chain, in order; the third is searched with `re.DOTALL` and has no group."""

_COMPILED = (re.compile(PATTERNS[0]), re.compile(PATTERNS[1]), re.compile(PATTERNS[2], re.DOTALL))


# ---------------------------------------------------------------------------------------------------------- data
def preprocess(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of `row` with plain-Python `options` minus the `"N/A"` padding entries."""
    out = dict(row)
    out["options"] = [opt for opt in list(row["options"]) if opt != "N/A"]
    return out


_LAYOUT_HINT = (
    "pass --data-dir DIR with the MMLU-Pro files in the dataset's schema (question_id, question, options, answer, "
    "answer_index, cot_content, category, src): DIR/mmlu_pro/test*.parquet|jsonl|json and "
    "DIR/mmlu_pro/validation*.parquet|jsonl|json (e.g. from `huggingface-cli download TIGER-Lab/MMLU-Pro "
    "--repo-type dataset --local-dir DIR/mmlu_pro` on a machine with network access)"
)


_ROW_FIX = (
    "fix the row or remove it (MMLU-Pro rows: question text, category non-empty text, options a list of option "
    "texts, answer the letter of the option at answer_index, counted from 0 (A = 0); validation rows: question, "
    "category, options and cot_content, the worked answer)"
)


def check_row(row: Mapping[str, Any], split: str = "test") -> str | None:
    """What makes `row` of `split` (`"test"` or `"validation"`) unusable, or None: the fields the protocol reads
    must be there with the dataset's types - `question` text, `category` non-empty text, `options` a list of option
    texts with at least one besides the `"N/A"` padding, and on test rows `answer` the letter (A, B, ...) of the
    option at `answer_index`, as the official data has it; on validation rows `cot_content` text."""
    needed = ("question", "options", "answer", "answer_index", "category") if split == "test" else (
        "question", "options", "cot_content", "category")
    missing = [f for f in needed if f not in row]
    if missing:
        return f"{split} row {_row_id(row)} lacks the field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    where = f"{split} row {_row_id(row)}"
    if not isinstance(row["question"], str):
        return f"{where}: `question` must be text, got {row['question']!r}"
    if not isinstance(row["category"], str) or not row["category"].strip():
        return f"{where}: `category` must be non-empty text (e.g. 'math'), got {row['category']!r}"
    options = row["options"]
    if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) for o in options):
        return f"{where}: `options` must be a list of option texts, got {options!r}"
    kept = [o for o in options if o != "N/A"]
    if not kept:
        return f"{where}: `options` has no option (besides \"N/A\" padding): {options!r}"
    if split != "test":
        return None if isinstance(row["cot_content"], str) else (
            f"{where}: `cot_content` must be text (the worked answer), got {row['cot_content']!r}")
    index, answer = row["answer_index"], row["answer"]
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(options):
        return (f"{where}: `answer_index` must be the position of the right option in `options`, from 0 to "
                f"{len(options) - 1}, got {index!r}")
    if answer != CHOICES[index]:
        return (f"{where}: `answer` must be the letter of the option at answer_index {index}, "
                f"{CHOICES[index]!r}, got {answer!r}")
    return None


def _row_id(row: Mapping[str, Any]) -> str:
    return f"(question_id {row['question_id']!r})" if "question_id" in row else "(no question_id)"


def load_mmlu_pro(
    data_dir: str | os.PathLike | None = None, *, validation: bool = True
) -> tuple[list[dict], list[dict]]:
    """The preprocessed `(test, validation)` rows, from `data_dir` when given, else from the hub.

    The validation rows are the worked examples of k-shot prompts; with `validation=False` (0-shot) they are
    neither read nor required and the second list is empty. Every row read is checked (`check_row`) before it is
    used.

    Raises:
        DataUnavailableError: the hub is unreachable (pass `data_dir`), the local files are missing, or the test
            split (the validation split, when read) has no rows.
        BadRecordError (a DataError): a row is malformed; the message names its file and row and what to fix.
    """
    val: list[dict] = []
    zero_shot = f"evaluate 0-shot (`kimi-vl eval --num-shots 0`; the quickstart evaluates {NUM_SHOTS}-shot)."
    empty_val_fix = f"k-shot prompts take their worked examples from the validation split: add its rows, or {zero_shot}"
    if data_dir is not None:
        test, test_files = load_local_split(data_dir, BENCHMARK_DIRS, "test", check=check_row, fix=_ROW_FIX)
        val_files: list = []
        if validation:
            val, val_files = load_local_split(data_dir, BENCHMARK_DIRS, "validation", hint=(
                f"k-shot prompts take their worked examples from the validation split: add the file, or {zero_shot}"),
                check=lambda r: check_row(r, "validation"), fix=_ROW_FIX)
        require_rows(test, "test", test_files, f"put the MMLU-Pro test split there ({_LAYOUT_HINT}).")
        if validation:
            require_rows(val, "validation", val_files, empty_val_fix)
    else:
        ds = load_hub_dataset(HF_REPO, None, hint=_LAYOUT_HINT)
        test = list(ds["test"])
        check_rows(list(enumerate(test, 1)), check_row, f"{HF_REPO} test split", _ROW_FIX)
        require_rows(test, "test", f"{HF_REPO} (hub)", f"{_LAYOUT_HINT}.")
        if validation:
            val = list(ds["validation"])
            check_rows(list(enumerate(val, 1)), lambda r: check_row(r, "validation"), f"{HF_REPO} validation split",
                       _ROW_FIX)
            require_rows(val, "validation", f"{HF_REPO} (hub)", empty_val_fix)
    return [preprocess(r) for r in test], [preprocess(r) for r in val]


def select_by_category(rows: Iterable[dict], category: str) -> list[dict]:
    """Rows of one category, in order."""
    return [r for r in rows if r["category"] == category]


def ordered_items(test: Sequence[dict], limit: int | None = None) -> list[dict]:
    """Test rows in the official evaluation order (categories sorted, rows in dataset order within each).

    With `limit`, the first `limit` rows taken round-robin over the categories (one from each in turn), so a
    small limit still covers every category.
    """
    cats = sorted({r["category"] for r in test})
    per_cat = [select_by_category(test, c) for c in cats]
    if limit is None:
        return [r for rows in per_cat for r in rows]
    if limit < 0:
        raise ConfigError(f"limit must be >= 0, got {limit}.")
    picked: list[list[dict]] = [[] for _ in cats]
    taken, depth = 0, 0
    while taken < limit and any(depth < len(rows) for rows in per_cat):
        for i, rows in enumerate(per_cat):
            if depth < len(rows) and taken < limit:
                picked[i].append(rows[depth])
                taken += 1
        depth += 1
    return [r for rows in picked for r in rows]


# ------------------------------------------------------------------------------------------------------- prompts
def format_cot_example(example: dict[str, Any], including_answer: bool = True) -> str:
    """One question block: `Question:\\n{q}\\nOptions:\\nA. ...\\n` plus the rewritten `cot_content` and a blank
    line (a shot), or `Answer: Let's think step by step.` (the question to answer)."""
    text = "Question:\n" + example["question"] + "\n" + "Options:\n"
    for letter, option in zip(CHOICES, example["options"]):
        text += f"{letter}. {option}\n"
    if including_answer:
        text += example["cot_content"].replace(COT_PREFIX_SHOT, COT_PREFIX) + "\n\n"
    else:
        text += COT_PREFIX
    return text


def build_prompt(val_rows: Sequence[dict], row: dict[str, Any], k: int = NUM_SHOTS) -> str:
    """The official k-shot CoT prompt for test `row`: the header for its category, the first `k` validation rows
    of that category as worked examples, then the question."""
    category = row["category"]
    shots = select_by_category(val_rows, category)[: max(k, 0)]
    prompt = INITIAL_PROMPT.replace("{$}", category) + "\n"
    for shot in shots:
        prompt += format_cot_example(shot, including_answer=True)
    return prompt + format_cot_example(row, including_answer=False)


def build_prompt_within_budget(
    val_rows: Sequence[dict],
    row: dict[str, Any],
    count_tokens: Callable[[str], int],
    *,
    k: int = NUM_SHOTS,
    max_model_length: int = MAX_MODEL_LENGTH,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> tuple[str, int]:
    """`(prompt, shots)`: the prompt with the most shots (at most `k`, and at most the category's validation rows)
    whose token count is below `max_model_length - max_new_tokens`, as the official script chooses it; `shots` is
    the number of worked examples in the prompt.

    Deviation: the official loop keeps decreasing `k` below 0 (where `val[:k]` wraps around); here it stops at
    0 shots and returns the 0-shot prompt even if that is still too long.
    """
    budget = max_model_length - max_new_tokens
    available = len(select_by_category(val_rows, row["category"]))
    for shots in range(min(max(k, 0), available), -1, -1):
        prompt = build_prompt(val_rows, row, shots)
        if shots == 0 or count_tokens(prompt) < budget:
            return prompt, shots
    raise AssertionError("unreachable")  # pragma: no cover


# ---------------------------------------------------------------------------------------------------- extraction
def extract_answer(text: str, level: int = 3) -> str | None:
    """The option letter the response `text` gives, or None.

    `level=3` is the current official chain (first match of each pattern of `PATTERNS` in order), `level=2` the
    first two patterns, `level=1` the first pattern alone (what produced the `pred` fields of the official result
    dumps). The random fallback for None belongs to scoring (`score`).
    """
    if level not in (1, 2, 3):
        raise ConfigError(f"level must be 1, 2 or 3, got {level}.")
    if text is None:
        return None
    for pattern in _COMPILED[:level]:
        match = pattern.search(text)
        if match:
            return match.group(1) if pattern.groups else match.group(0)
    return None


def baselines(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What answering without reading gets on `rows`: `chance` (uniform guessing, 1 / options) and `constant` (always
    the most frequent correct letter; `constant_answer` names it)."""
    if not rows:
        return {"chance": 0.0, "constant": 0.0, "constant_answer": "none"}
    counts = Counter(r["answer"] for r in rows)
    letter, hits = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"chance": sum(1 / len(r["options"]) for r in rows) / len(rows), "constant": hits / len(rows),
            "constant_answer": f"always ({letter})"}


def random_guess(num_options: int, seed: int = RANDOM_SEED) -> int:
    """The official fallback guess for a question with `num_options` options: `random.seed(seed)` then
    `random.randint(0, num_options - 1)` (the global RNG is left untouched)."""
    return random.Random(seed).randint(0, num_options - 1)


def is_correct(row: dict[str, Any], pred: str | None) -> bool:
    """Official per-question correctness: `pred == answer`, or for a missing prediction the random guess."""
    if not pred:
        return random_guess(len(row["options"])) == row["answer_index"]
    return pred == row["answer"]


def score(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over all records and per category.

    Each record needs `category`, `answer`, `answer_index`, `options` and `pred` (the extracted letter or None).
    Returns `{"accuracy", "correct", "total", "random_guesses", "categories": {category: {"accuracy",
    "correct", "total"}}}` with categories sorted by name; accuracies are fractions in [0, 1].
    """
    cats: dict[str, list[int]] = {}
    guesses = 0
    for rec in records:
        guesses += not rec["pred"]
        c = cats.setdefault(rec["category"], [0, 0])
        c[0] += is_correct(rec, rec["pred"])
        c[1] += 1
    correct = sum(c for c, _ in cats.values())
    total = sum(t for _, t in cats.values())
    return {
        "accuracy": correct / total if total else 0.0,
        "correct": correct,
        "total": total,
        "random_guesses": guesses,
        "categories": {
            name: {"accuracy": c / t if t else 0.0, "correct": c, "total": t} for name, (c, t) in sorted(cats.items())
        },
    }


__all__ = [
    "CATEGORIES",
    "CHOICES",
    "HF_REPO",
    "INITIAL_PROMPT",
    "MAX_MODEL_LENGTH",
    "MAX_NEW_TOKENS",
    "NUM_SHOTS",
    "PATTERNS",
    "STOP",
    "build_prompt",
    "build_prompt_within_budget",
    "check_row",
    "extract_answer",
    "format_cot_example",
    "is_correct",
    "load_mmlu_pro",
    "ordered_items",
    "preprocess",
    "random_guess",
    "score",
    "select_by_category",
]
