"""Evaluation: MMLU-Pro and MathVista with their official protocols, offline proxies from the synthetic world,
reports (JSON + Markdown + plots) and the `kimi-vl eval` runner.

- `kimi_vl.eval.mmlu_pro`: 5-shot CoT prompt, answer extraction (`extract_answer(text, level=3)`), scoring.
- `kimi_vl.eval.mathvista`: query construction, answer extraction, normalisation, `is_correct`, `compute_scores`.
- `kimi_vl.eval.registry`: what a benchmark is (`Benchmark`: load, build prompts, extract, score) and the registry
  (`register`, `parse_benchmarks`); `kimi_vl.eval.benchmarks` registers the four built-in ones.
- `kimi_vl.eval.config`: `EvalConfig`, the typed evaluation options (and the `kimi-vl eval` options).
- `kimi_vl.eval.runner`: `evaluate(model_dir, benchmarks, out_dir, config)`, `add_eval_arguments`,
  `run_eval_from_args`.
"""

from . import mathvista, mmlu_pro
from .config import EvalConfig
from .data import DataUnavailableError
from .generation import Engine, GenerationRequest
from .registry import BENCHMARKS, Benchmark, BenchmarkData, Item, Prompts, parse_benchmarks, register, unregister
from .runner import EvalRun, add_eval_arguments, evaluate, run_eval_from_args

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "BenchmarkData",
    "DataUnavailableError",
    "Engine",
    "EvalConfig",
    "EvalRun",
    "GenerationRequest",
    "Item",
    "Prompts",
    "add_eval_arguments",
    "evaluate",
    "mathvista",
    "mmlu_pro",
    "parse_benchmarks",
    "register",
    "run_eval_from_args",
    "unregister",
]
