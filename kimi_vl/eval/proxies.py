"""Offline proxies of the two benchmarks, built from the synthetic world (`kimi_vl.data.world`).

- `mmlu_pro_synth`: multiple-choice questions in the MMLU-Pro schema (`mmlu_pro_rows`), evaluated exactly like
  MMLU-Pro (same 5-shot CoT prompt with worked examples drawn from a separate seed, same extraction and scoring).
- `mathvista_synth`: image problems in the MathVista testmini schema (`mathvista_rows`, images written under the
  output directory), with the official query construction, extraction, normalisation and scores.

They need no download and measure the same skills on the world's own distribution; they are NOT the benchmarks
and every report labels them "(synthetic proxy)". Their items are held out by construction: they come from the
world's `eval` split (`kimi_vl.data.world.split_of`), whose questions, chart values, rectangles, pages and images no
training draw ever produces (what a question asks about, a creature's fact or an expression's result, is met in
training under other wordings, as real benchmarks test knowledge their items do not teach); `proxy_split="val"`
draws the validation split instead, for tuning, and the worked examples of `mmlu_pro_synth` always come from the
validation split. `kimi_vl.eval.benchmarks` registers them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..data import world
from .config import PROXY_SEED, EvalConfig
from .mathvista import build_query
from .mmlu_pro import preprocess

MMLU_PRO_SYNTH_SIZE = 140
MATHVISTA_SYNTH_SIZE = 100
SHOT_POOL = 140
"""Validation-split rows generated to pick the per-category worked examples of `mmlu_pro_synth` from."""
PROXY_EVAL_CONFIG = EvalConfig(num_shots=0, mmlu_pro_format="chat", max_new_tokens=96)
"""`evaluate` options the quickstart and the Vision-RL ablation use on the proxies: zero-shot chat prompts (five
worked examples do not fit the tiny model's 256-token context) and 96 new tokens (the longest target reply, a
five-bar chart's multiple choice, is about 60 tokens)."""


def mmlu_pro_synth(n: int = MMLU_PRO_SYNTH_SIZE, seed: int = PROXY_SEED, split: str = "eval"
                   ) -> tuple[list[dict], list[dict]]:
    """`(test, validation)` rows of the MMLU-Pro proxy: test rows from `split`, validation rows (carrying
    `cot_content`, the worked examples) from the validation split."""
    test = [preprocess(r) for r in world.mmlu_pro_rows(n, seed, split)]
    pool = [preprocess(r) for r in world.mmlu_pro_rows(max(SHOT_POOL, n), seed + 1, "val")]
    val = [r for r in pool if r.get("cot_content")]
    return test, val


def lookup_misses(records: list[dict[str, Any]]) -> int:
    """How many of the MMLU-Pro proxy's scored `records` (rows with `options`, `answer` and the reply
    `model_outputs`) work out the right option's value and then write another letter for it: the reply's last
    "The option 42 is (C)." step (`world.option_lookup`) names the right value with a wrong letter. These are the
    misses of the option-letter lookup alone, the step the pre-training drill teaches."""
    misses = 0
    for r in records:
        steps = world.option_lookups(r["model_outputs"])
        if steps and steps[-1][0] == r["options"][ord(r["answer"]) - ord("A")] and steps[-1][1] != r["answer"]:
            misses += 1
    return misses


def mathvista_synth(
    image_dir: str | os.PathLike, n: int = MATHVISTA_SYNTH_SIZE, seed: int = PROXY_SEED, split: str = "eval"
) -> dict[str, dict[str, Any]]:
    """`{pid: row}` of the MathVista proxy from `split`; images are written under `image_dir` and each row gets its
    `query` (official construction) when the world left it out."""
    root = Path(image_dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = world.mathvista_rows(n, seed, root, split)
    out: dict[str, dict[str, Any]] = {}
    for pid, row in rows.items():
        row = dict(row)
        row.setdefault("pid", str(pid))
        if not row.get("query"):
            row["query"] = build_query(row)
        row.setdefault("_image_root", str(root))
        out[str(pid)] = row
    return out


__all__ = [
    "MATHVISTA_SYNTH_SIZE", "MMLU_PRO_SYNTH_SIZE", "PROXY_EVAL_CONFIG", "PROXY_SEED", "mathvista_synth",
    "mmlu_pro_synth",
]
