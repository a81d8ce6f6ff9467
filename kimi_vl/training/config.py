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
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.config import DataConfig
from ..errors import ConfigError
from .presets import get_preset
from .rl import RLConfig
from .trainer import TrainConfig

STAGES: tuple[str, ...] = ("pretrain", "sft", "rl")
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
        out = {"stage": self.stage, "preset": self.preset, "seed": self.seed, "train": dataclasses.asdict(self.train),
               "data": dataclasses.asdict(self.data)}
        if self.rl is not None:
            out["rl"] = dataclasses.asdict(self.rl)
        return out


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


def attribute_docs(cls: type) -> dict[str, str]:
    """`name -> description` from a class docstring's `Attributes:` section."""
    doc = cls.__doc__ or ""
    if "Attributes:" not in doc:
        return {}
    out: dict[str, str] = {}
    name = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        m = re.match(r"^\s{8}(\w+(?:, \w+)*):\s*(.*)$", line)
        if m:
            names = m.group(1).split(", ")
            for n in names:
                out[n] = m.group(2).strip()
            name = names
        elif name and line.startswith(" " * 12) and line.strip():
            for n in name:
                out[n] += " " + line.strip()
        elif line.strip() == "":
            continue
        else:
            name = None
    return out


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(hint: Any) -> tuple[Any, bool]:
    """`(inner type, whether None is allowed)` of a type hint."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


def _scalar(text: str, kind: type, name: str) -> Any:
    if kind is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: {text!r} is not a boolean (true/false).")
    try:
        return kind(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {text!r} is not a valid {kind.__name__}.") from exc


def coerce(value: Any, hint: Any, name: str) -> Any:
    """`value` (from a config file or the command line) as the field's type: numbers from strings, "none" for an
    optional field, lists from a string of comma-separated items, `{str: float}` dicts from `k=v,k=v`."""
    kind, optional = _optional(hint)
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if not optional:
            raise ConfigError(f"{name} cannot be none.")
        return None
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}.")
        return [coerce(v.strip() if isinstance(v, str) else v, item, name) for v in items]
    if origin is dict:
        _, item = typing.get_args(kind)
        if isinstance(value, str):
            pairs = [p.partition("=") for p in value.split(",") if p.strip()]
            if any(not sep for _, sep, _ in pairs):
                raise ConfigError(f"{name}: write key=value pairs separated by commas, got {value!r}.")
            value = {k.strip(): v for k, _, v in pairs}
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {value!r}.")
        return {str(k): coerce(v, item, f"{name}.{k}") for k, v in value.items()}
    if isinstance(value, str):
        return _scalar(value, kind, name)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be a {kind.__name__}, got {value!r}.")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The flat settings of a YAML or JSON file (`train` / `data` / `rl` sections flattened; `stage` ignored;
    `preset` and `seed` kept)."""
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
        if "split" in f.metadata and isinstance(value, (list, tuple)):  # --tasks text,vision
            value = [item for v in value for item in (v.split(f.metadata["split"]) if isinstance(v, str) else [v])]
        changes[section][name] = coerce(value, _hints(SECTIONS[section])[name], name)
    resolved = {k: (dataclasses.replace(v, **changes[k]) if v is not None else None) for k, v in sections.items()}
    return RunConfig(stage, preset, int(seed), resolved["train"], resolved["data"], resolved["rl"])


def write_run_config(config: RunConfig, out_dir: str | Path) -> Path:
    """Write the resolved configuration to `out_dir/run_config.json`."""
    path = Path(out_dir) / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.to_dict(), indent=1))
    return path


# ------------------------------------------------------------------------------------------------------ command line
def flag(name: str, f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def add_stage_options(parser: argparse.ArgumentParser, stage: str) -> None:
    """One option per setting of `stage` (defaults left to the preset: only given options reach the namespace)."""
    docs = {section: attribute_docs(cls) for section, cls in SECTIONS.items()}
    groups = {s: parser.add_argument_group(f"{s} settings") for s in SECTIONS}
    for name, (section, f) in stage_fields(stage).items():
        kind, _ = _optional(_hints(SECTIONS[section])[name])
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": docs[section].get(name, "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            kwargs.update(action="append", metavar="VALUE")
        else:
            kwargs["metavar"] = {int: "N", float: "X"}.get(kind, "VALUE")
        groups[section].add_argument(flag(name, f), **kwargs)


def stage_overrides(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    """The settings of `stage` given on the command line (raw values; `resolve` coerces them)."""
    return {name: getattr(args, name) for name in stage_fields(stage) if hasattr(args, name)}


__all__ = ["RUN_CONFIG", "STAGES", "RunConfig", "add_stage_options", "attribute_docs", "coerce",
           "load_config_file", "resolve", "stage_fields", "stage_overrides", "write_run_config"]
