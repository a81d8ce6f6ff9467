"""Typed configuration of a training run, and the `kimi-vl train` options generated from it.

A run of a stage is configured by `TrainConfig` (optimizer and loop), `DataConfig` (data and packing) and, for RL,
`RLConfig` (rollouts and objective). Every field that applies to the stage (a field's `stages` metadata; by
default `TrainConfig` fields apply to every stage, `RLConfig` fields to rl) is:
- a command-line option named after it (`lr` -> `--lr`, `grad_accum` -> `--grad-accum`; a few have a `flag`
  of their own, e.g. `sources` -> `--data`), its help taken from the class docstring's `Attributes:`;
- a key of `--config FILE` (YAML or JSON, flat, the field's or the option's name with `_` or `-`, e.g. `data` or
  `sources`; the `train` / `data` / `rl` sections of a written `run_config.json` are accepted too, so a run's
  resolved file can be passed back).

Precedence: the preset's values, then the config file's, then the command line's. `resolve` checks every name and
value; the resolved configuration is written to the run folder (`write_run_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.config import DataConfig
from ..errors import ConfigError
from ..options import add_dataclass_options, attribute_docs, coerce, flag
from .presets import get_preset
from .rl import RLConfig
from .trainer import TrainConfig

STAGES: tuple[str, ...] = ("vit", "pretrain", "sft", "rl")
SECTIONS: dict[str, type] = {"train": TrainConfig, "data": DataConfig, "rl": RLConfig}
_DEFAULT_STAGES = {TrainConfig: STAGES, DataConfig: STAGES, RLConfig: ("rl",)}
RUN_CONFIG = "run_config.json"


@dataclass
class RunConfig:
    """The resolved configuration of one stage run."""

    stage: str
    preset: str
    seed: int
    train: TrainConfig
    data: DataConfig
    rl: RLConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stage, preset, seed and each section's settings that apply to the stage (`stage_fields`: what
        `--config` accepts back for it)."""
        fields = stage_fields(self.stage)
        out: dict[str, Any] = {"stage": self.stage, "preset": self.preset, "seed": self.seed}
        for section, value in (("train", self.train), ("data", self.data), ("rl", self.rl)):
            if value is not None:
                out[section] = {k: v for k, v in dataclasses.asdict(value).items()
                                if fields.get(k, ("",))[0] == section}
        return out

    def flat(self) -> dict[str, Any]:
        """`to_dict` with its sections merged: the stage, preset, seed and every setting of the stage by name (what
        the trainer gives `report_to`'s trackers as hyperparameters)."""
        out = self.to_dict()
        return {k: v for key, value in out.items() for k, v in (value.items() if key in SECTIONS else [(key, value)])}


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}.")


def stage_fields(stage: str) -> dict[str, tuple[str, dataclasses.Field]]:
    """`name -> (section, field)` of every setting that applies to `stage`."""
    _check_stage(stage)
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if stage in f.metadata.get("stages", _DEFAULT_STAGES[cls]):
                if f.name in out:
                    raise ConfigError(f"the setting {f.name!r} is defined twice for {stage} ({out[f.name][0]} and "
                                      f"{section}); rename one.")
                out[f.name] = (section, f)
    return out


_ALL_SETTINGS = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
"""Every setting of every stage (a written run configuration's other-stage settings are dropped on load)."""


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The flat settings of a YAML or JSON file (`train` / `data` / `rl` sections flattened; `stage` ignored;
    `preset` and `seed` kept). In a run's written `run_config.json` (`stage`, `preset`, `seed` and the sections),
    settings of other stages than its own are dropped, as older runs wrote them all."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist.")
    text = path.read_text()
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as exc:  # yaml.YAMLError / JSONDecodeError
        raise ConfigError(f"config file {path} cannot be parsed ({exc}).") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of setting names to values.")
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        elif key != "stage":
            flat[key.replace("-", "_")] = value
    if {"stage", "preset", "seed", "train", "data"} <= raw.keys():  # a written run_config.json: files before
        # 2026-11-28 held every stage's settings; those of other stages are dropped
        written = stage_fields(str(raw["stage"]))
        flat = {k: v for k, v in flat.items() if k in written or k in ("preset", "seed") or k not in _ALL_SETTINGS}
    return flat


def resolve(stage: str, preset: str, overrides: dict[str, Any] | None = None, *, seed: int = 0) -> RunConfig:
    """The stage's configuration: the preset's, with `overrides` (flat setting names) applied and checked."""
    fields = stage_fields(stage)
    p = get_preset(preset)
    sections: dict[str, Any] = {"train": p.stages[stage], "data": p.data[stage],
                                "rl": p.rl_algorithm if stage == "rl" else None}
    changes: dict[str, dict[str, Any]] = {"train": {}, "data": {}, "rl": {}}
    aliases = {flag(name, f)[2:].replace("-", "_"): name for name, (_, f) in fields.items()}  # data -> sources
    overrides = {aliases.get(k, k): v for k, v in (overrides or {}).items()}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        known = sorted({*fields, *aliases})
        raise ConfigError(f"unknown setting(s) {unknown} for `train {stage}`; known: {', '.join(known)}.")
    for name, value in overrides.items():
        section, f = fields[name]
        if "split" in f.metadata and isinstance(value, (list, tuple)):  # --families text,vision
            value = [item for v in value for item in (v.split(f.metadata["split"]) if isinstance(v, str) else [v])]
        if "join" in f.metadata and isinstance(value, (list, tuple)):  # report_to=["tensorboard", "wandb"]
            value = f.metadata["join"].join(map(str, value))
        changes[section][name] = coerce(value, typing.get_type_hints(SECTIONS[section])[name], name)
    resolved = {k: (dataclasses.replace(v, **changes[k]) if v is not None else None) for k, v in sections.items()}
    return RunConfig(stage, preset, int(seed), resolved["train"], resolved["data"], resolved["rl"])


def write_run_config(config: RunConfig, out_dir: str | Path) -> Path:
    """Write the resolved configuration to `out_dir/run_config.json`."""
    path = Path(out_dir) / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.to_dict(), indent=1))
    return path


# ------------------------------------------------------------------------------------------------------ command line
def add_stage_options(parser: argparse.ArgumentParser, stage: str) -> None:
    """One option per setting of `stage` in a group per section (defaults left to the preset: only given options
    reach the namespace)."""
    fields = stage_fields(stage)
    for section, cls in SECTIONS.items():
        chosen = [f for _, (s, f) in fields.items() if s == section]
        if chosen:
            add_dataclass_options(parser.add_argument_group(f"{section} settings"), chosen,
                                  typing.get_type_hints(cls), attribute_docs(cls))


def stage_overrides(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    """The settings of `stage` given on the command line (raw values; `resolve` coerces them)."""
    return {name: getattr(args, name) for name in stage_fields(stage) if hasattr(args, name)}


__all__ = ["RUN_CONFIG", "STAGES", "RunConfig", "add_stage_options", "load_config_file", "resolve", "stage_fields",
           "stage_overrides", "write_run_config"]
