"""Typed evaluation options (`EvalConfig`), and the `kimi-vl eval` options generated from them.

Every field of `EvalConfig` is a command-line option named after it (`num_shots` -> `--num-shots`; booleans get a
`--no-` form, e.g. `--no-progress`), its help taken from the class docstring's `Attributes:` line, as for the
`kimi-vl train` options (`kimi_vl.options` builds both).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..options import add_dataclass_options, attribute_docs, coerce
from . import mmlu_pro as mp

PROXY_SEED = 90_210
"""Default seed of the synthetic proxies: far from the small seeds training streams use, to keep proxy items apart
from training samples."""
MATHVISTA_EXTRACTORS = ("heuristic", "rules", "self")


@dataclass(frozen=True)
class EvalConfig:
    """How `kimi_vl.eval.runner.evaluate` runs (which benchmarks, on which model, into which folder, are its
    arguments). Values are checked and converted on construction (`"8"` -> 8, a path -> its string; ConfigError
    when one is invalid); `dataclasses.replace(config, limit=10)` gives a changed copy.

    Attributes:
        data_dir: local benchmark files (DIR/mmlu_pro/test*.parquet|jsonl, DIR/mmlu_pro/validation*...,
            DIR/mathvista/testmini.json + images/); none: download them from the hub.
        limit: at most N items per benchmark, N >= 1 (MMLU-Pro: round-robin over categories; MathVista: the first
            ones; proxies: that many generated items); none: all.
        batch_size: prompts per generation batch.
        max_new_tokens: generation budget of every benchmark; none: each benchmark's own (2048 MMLU-Pro, 1024
            MathVista, 128 proxies).
        device: torch device; none: cuda when available.
        dtype: model dtype (auto: bfloat16 on CUDA, float32 on CPU).
        trust_remote_code: allow remote-code models.
        num_shots: MMLU-Pro worked examples per prompt (0 needs no validation split).
        max_model_length: MMLU-Pro context length of the shot budget (the model's max_position_embeddings when
            smaller).
        mmlu_pro_format: official (raw completion prompt) or chat (the same prompt as one user turn).
        mathvista_format: chat (query and image as a user turn through the chat template) or raw (the image's
            placeholder, then the query, as a raw prompt).
        mathvista_extractor: what extracts the answers the official rules leave undecided (officially GPT; see the
            report's deviations): heuristic (a rule-based stand-in), rules (none: they count as empty), self (the
            evaluated model) or a saved model directory (that model).
        quick_extract: the official quick-extract rule of MathVista.
        proxy_seed: seed of the synthetic proxies.
        proxy_split: split of the world the proxies draw their items from: eval (held out from every training
            draw: the reported figures) or val (the validation draw, for tuning settings).
        progress: show progress (a bar on a terminal or in a notebook, a line every 30 s in a log).
    """

    data_dir: str | None = None
    limit: int | None = None
    batch_size: int = 8
    max_new_tokens: int | None = None
    device: str | None = None
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})
    trust_remote_code: bool = False
    num_shots: int = mp.NUM_SHOTS
    max_model_length: int = mp.MAX_MODEL_LENGTH
    mmlu_pro_format: str = field(default="official", metadata={"choices": ("official", "chat")})
    mathvista_format: str = field(default="chat", metadata={"choices": ("chat", "raw")})
    mathvista_extractor: str = "heuristic"
    quick_extract: bool = True
    proxy_seed: int = PROXY_SEED
    proxy_split: str = field(default="eval", metadata={"choices": ("eval", "val")})
    progress: bool = True

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            value = os.fspath(value) if isinstance(value, os.PathLike) else value
            value = coerce(value, hints[f.name], f.name)
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                raise ConfigError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}; got {value!r}.")
            object.__setattr__(self, f.name, value)
        minimum = {"limit": 1, "batch_size": 1, "max_new_tokens": 1, "num_shots": 0, "max_model_length": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}.")
        spec = self.mathvista_extractor
        if spec not in MATHVISTA_EXTRACTORS and not (Path(spec) / "config.json").is_file():
            raise ConfigError(f"mathvista_extractor must be one of {', '.join(MATHVISTA_EXTRACTORS)} or a saved model "
                              f"directory; {spec!r} is neither.")

    def to_dict(self) -> dict[str, Any]:
        """Every field (JSON-ready)."""
        return dataclasses.asdict(self)

    def changes(self) -> dict[str, Any]:
        """The fields set to other values than their defaults (JSON-ready), e.g. to state a run's settings."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


def add_config_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One option per `EvalConfig` field; only the given ones reach the namespace (see `config_from_args`)."""
    docs = {f.name: (text if f.default is None else f"{text.rstrip('.')} (default: {f.default}).")
            for f in dataclasses.fields(EvalConfig) for text in [attribute_docs(EvalConfig)[f.name]]}
    add_dataclass_options(parser, list(dataclasses.fields(EvalConfig)), typing.get_type_hints(EvalConfig), docs)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The `EvalConfig` of parsed `add_config_options` options (defaults for those not given)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EvalConfig) if hasattr(args, f.name)}
    return EvalConfig(**given)


__all__ = ["EvalConfig", "MATHVISTA_EXTRACTORS", "PROXY_SEED", "add_config_options", "config_from_args"]
