"""The embedded text corpus: the running Python's standard library sources, and the mix of texts the BPE tokenizer
is trained on. Nothing is downloaded.

The standard library is found with `sysconfig.get_paths()["stdlib"]`; its `.py` files are taken in sorted order of
their relative paths, skipping test suites (`test/`, `tests/`), GUI packages (`idlelib/`, `tkinter/`, `turtledemo/`),
installed packages (`site-packages/`, `dist-packages/`) and files that are unreadable or not UTF-8. The corpus is
therefore deterministic for a given Python installation (and differs between Python versions).
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from functools import cache, lru_cache
from pathlib import Path

from ..errors import ConfigError
from .screencast import page_html, random_page
from .world import SCREENCAST_QUESTION, TEXT_TASKS, VISION_TASKS, make_sample, make_samples, sample_rng, sample_text

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages",
                        "__pycache__"})


@lru_cache(maxsize=1)
def stdlib_paths() -> tuple[Path, ...]:
    """The standard library's `.py` files (see the module docstring), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"the standard library directory {root} does not exist; this Python installation has no "
                          "sources to train on (install the full Python, not an embedded/zip-only build).")
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        found.append((rel.as_posix(), path))
    found.sort()
    return tuple(path for _, path in found)


@cache
def read_source(path: Path) -> str:
    """The text of one source file ("" when it cannot be read or is not UTF-8); cached."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def stdlib_documents(max_chars: int | None = None) -> list[str]:
    """The standard library's `.py` sources, one string per file, sorted by path (deterministic).

    Args:
        max_chars: cap on the total number of characters; the last document is cut so the total is exactly
            `min(max_chars, size of the corpus)`. None: every file.
    """
    if max_chars is not None and max_chars < 0:
        raise ConfigError(f"max_chars must be >= 0 or None, got {max_chars}.")
    docs: list[str] = []
    total = 0
    for path in stdlib_paths():
        text = read_source(path)
        if not text:
            continue
        if max_chars is not None and total + len(text) > max_chars:
            if max_chars > total:
                docs.append(text[: max_chars - total])
            break
        docs.append(text)
        total += len(text)
    return docs


def stdlib_window(rng: random.Random, num_chars: int) -> tuple[str, bool]:
    """A random excerpt of about `num_chars` characters of one standard library file, starting at a line start.

    Returns `(text, at_end)`: `at_end` says the excerpt reaches the end of its file.
    """
    paths = stdlib_paths()
    text = ""
    for _ in range(100):  # an unreadable file is skipped by drawing again
        text = read_source(paths[rng.randrange(len(paths))]) if paths else ""
        if text:
            break
    else:
        raise ConfigError("no readable .py file was found in the standard library; the text corpus is empty.")
    start = rng.randrange(max(1, len(text) - num_chars // 2))
    if start:
        newline = text.find("\n", start)
        start = newline + 1 if newline != -1 else 0
    end = min(len(text), start + num_chars)
    return text[start:end], end == len(text)


def _chat_formats(rng: random.Random) -> str:
    """Answer formats the evaluations expect, as plain text (no special tokens)."""
    letter = "ABCDEFGHIJ"[rng.randrange(10)]
    number = rng.randint(0, 999)
    return rng.choice((
        f"Let's think step by step. The answer is ({letter}).",
        f"Answer: Let's think step by step. The answer is ({letter}).",
        f"The answer is {number}.",
        f"The answer is {number / 10:.1f}.",
        f"Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, "
        f"at the end.\nQuestion: What is {number} + 1?\nThe answer is {number + 1}.",
        f"The following are multiple choice questions (with answers) about math. Think step by step and then finish "
        f'your answer with "the answer is (X)" where X is the correct letter choice.\nThe answer is ({letter}).',
        f"```python\nimport numpy as np\nfrom PIL import Image\nimg = np.asarray(Image.open(\"image.png\"))\n"
        f"print(img.shape)\n```\nThe answer is {number}.",
    ))


@lru_cache(maxsize=4)
def _vision_texts(seed: int, size: int = 256) -> tuple[str, ...]:
    """Pre-training texts of `size` image samples (drawing images is the slow part: a fixed pool is reused)."""
    return tuple(sample_text(s) for s in make_samples(VISION_TASKS, size, seed))


def tokenizer_texts(seed: int, n: int) -> Iterator[str]:
    """`n` texts to train the BPE tokenizer on, deterministic by `seed`.

    Text `i` is, by `i % 4`: 0 a ~2000-character standard library excerpt; 1 three world text samples (arithmetic,
    multiple choice, facts) in pre-training form; 2 an image sample's question and response in pre-training form
    (drawn from a pool of 256 image samples) or, one time in four, a screencast question with its page HTML;
    3 answer formats of the evaluations ("The answer is (B).", MMLU-Pro and MathVista prompts, a Python snippet).
    No text contains special tokens.
    """
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}.")
    for i in range(n):
        rng = sample_rng(seed, i, "tokenizer")
        kind = i % 4
        if kind == 0:
            yield stdlib_window(rng, 2000)[0]
        elif kind == 1:
            yield "\n\n".join(sample_text(make_sample(rng.choice(TEXT_TASKS), rng)) for _ in range(3))
        elif kind == 2:
            if rng.random() < 0.25:
                yield f"Question: {SCREENCAST_QUESTION}\nAnswer: {page_html(random_page(rng))}"
            else:
                pool = _vision_texts(seed)
                yield pool[rng.randrange(len(pool))]
        else:
            yield _chat_formats(rng)


__all__ = ["read_source", "stdlib_documents", "stdlib_paths", "stdlib_window", "tokenizer_texts"]
