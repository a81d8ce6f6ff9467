"""Evaluation: MMLU-Pro and MathVista with their official protocols, offline proxies from the synthetic world,
reports (JSON + Markdown + plots) and the `kimi-vl eval` runner.

- `kimi_vl.eval.mmlu_pro`: 5-shot CoT prompt, answer extraction (`extract_answer(text, level=3)`), scoring.
- `kimi_vl.eval.mathvista`: query construction, answer extraction, normalisation, `is_correct`, `compute_scores`.
- `kimi_vl.eval.runner`: `evaluate(model_dir, tasks, out_dir, ...)`, `add_eval_arguments`, `run_eval_from_args`.
"""

from . import mathvista, mmlu_pro
from .data import DataUnavailableError
from .generation import Engine, GenerationRequest
from .runner import TASKS, add_eval_arguments, evaluate, parse_tasks, run_eval_from_args

__all__ = [
    "DataUnavailableError",
    "Engine",
    "GenerationRequest",
    "TASKS",
    "add_eval_arguments",
    "evaluate",
    "mathvista",
    "mmlu_pro",
    "parse_tasks",
    "run_eval_from_args",
]
