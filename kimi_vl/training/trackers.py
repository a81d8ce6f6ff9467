"""Experiment trackers (`report_to`): the trainer's step metrics also sent to TensorBoard, Weights & Biases, MLflow,
Trackio, ... through accelerate's trackers.

`metrics.jsonl` stays the record of a run; a tracker gets the same numbers as flat scalars (`loss`, `lr`,
`grad_norm`, `val_loss`, `reward_mean`, `max_logits/<layer>`, `expert_load/<router>`, `bad_records/<source>`, ...),
at the same step. A resumed run sends again the steps after its last checkpoint (they are trained again).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..errors import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio", "aim", "comet_ml", "clearml", "dvclive", "swanlab")
"""The tracker names `report_to` accepts (accelerate's); each needs its own package installed."""

PACKAGES = {"comet_ml": "comet-ml"}
"""pip names that differ from the tracker's."""


def parse_report_to(value: str | None) -> list[str]:
    """`"tensorboard,wandb"` -> `["tensorboard", "wandb"]` (none, "" or "none": no tracker); `ConfigError` naming an
    unknown tracker."""
    if value is None:
        return []
    names = [n.strip() for n in value.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"report_to: unknown tracker(s) {unknown}; choose from {', '.join(TRACKERS)} "
                          "(comma-separated), or none.")
    return list(dict.fromkeys(names))


def check_installed(names: list[str]) -> None:
    """`ConfigError` for a tracker whose package is missing (accelerate would drop it without a word)."""
    if not names:
        return
    from accelerate.tracking import get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    missing = [n for n in names if n not in available]
    if missing:
        raise ConfigError(f"report_to: {', '.join(missing)} is not installed; `pip install "
                          f"{' '.join(PACKAGES.get(n, n) for n in missing)}`, or drop it from --report-to.")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A `metrics.jsonl` record as flat numeric scalars: nested dicts become `key/subkey`, booleans 0 / 1; the step
    and other values (strings, lists, none) are left out."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":  # the x axis, given to the tracker as such
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, (bool, int, float)):
                flat[key if sub is None else f"{key}/{sub}"] = float(v)
    return flat


def hyperparameters(settings: Any) -> dict[str, bool | int | float | str]:
    """A `TrainConfig`, or a flat mapping of settings (a stage's: `RunConfig.flat`), as the flat hyperparameters
    trackers take (none as the string "none", lists and mappings as their text)."""
    items = settings.items() if isinstance(settings, dict) else asdict(settings).items()
    return {k: v if isinstance(v, (bool, int, float, str)) else "none" if v is None else str(v) for k, v in items}


__all__ = ["TRACKERS", "check_installed", "hyperparameters", "parse_report_to", "scalars"]
