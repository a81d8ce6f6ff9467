"""Levenshtein edit distance, shared by the OCR reward and MathVista's nearest-choice normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def levenshtein(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1) between two sequences (e.g. strings)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]
