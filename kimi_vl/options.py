"""Typed settings as command-line options: a dataclass's fields become `argparse` options, their help taken from
the class docstring's `Attributes:` section, their values coerced to the field types. `kimi-vl train` (the training
`TrainConfig`, `DataConfig`, `RLConfig`) and `kimi-vl eval` (`EvalConfig`) build their options with it."""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from .errors import ConfigError


def positive_int(text: str) -> int:
    """An `argparse` type: an integer >= 1."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def check_output_dir(path: str | Path, option: str = "--out") -> None:
    """`ConfigError` when the output folder `path` cannot be one: it, or a folder it would be made in, is an existing
    file (`option` names the command-line option in the message)."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "" if folder == path else f" lies in {folder}, which"
                raise ConfigError(f"{option} {path}{where} is a file, not a directory; pass a directory path.")
            return


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


def optional_type(hint: Any) -> tuple[Any, bool]:
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


def _is_none(value: Any) -> bool:
    """Whether a setting's value says none: None, or the string none / null."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))


def coerce(value: Any, hint: Any, name: str) -> Any:
    """`value` (from a config file, the command line or Python) as the field's type: numbers from strings, "none" for
    an optional field (for a list: the empty list), lists from a string of comma-separated items, `{str: float}`
    dicts from `k=v,k=v`, strings from paths (`pathlib.Path`; a list field takes one path as its one item), numbers
    from any integer or real type (numpy's)."""
    kind, optional = optional_type(hint)
    origin = typing.get_origin(kind)
    if origin is list and (_is_none(value) or (isinstance(value, (list, tuple)) and len(value) == 1
                                               and _is_none(value[0]))):
        return []  # `--data none` (a repeatable option's one value), `data: null`: no items
    if value is None or (optional and _is_none(value)):
        if not optional:
            raise ConfigError(f"{name} cannot be none.")
        return None
    if isinstance(value, os.PathLike):  # a path is one item, never split at its commas
        value = [os.fspath(value)] if origin is list else os.fspath(value)
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
    if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's numbers too
        return float(value)
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be a {kind.__name__}, got {value!r}.")
    return value


def flag(name: str, f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def add_dataclass_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                          fields: list[dataclasses.Field], hints: dict[str, Any], docs: dict[str, str]) -> None:
    """One option per field (`flag`): `--x/--no-x` for booleans, repeatable for lists, `N` / `X` / `VALUE`
    placeholders; the default is left out of the namespace (only given options reach it), `choices` metadata is
    passed on, and the help is the field's `docs` entry."""
    for f in fields:
        kind, _ = optional_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                                  "help": docs.get(f.name, "").replace("%", "%%")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            kwargs.update(action="append", metavar="VALUE")
        else:
            kwargs["metavar"] = {int: "N", float: "X"}.get(kind, "VALUE")
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
            kwargs.pop("metavar", None)
        parser.add_argument(flag(f.name, f), **kwargs)


__all__ = ["add_dataclass_options", "attribute_docs", "coerce", "flag", "optional_type"]
