"""Exception types users can catch. Every user-facing failure raises a `KimiVLError` subclass
whose message says what was wrong and how to fix it."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePath
from typing import Any


class KimiVLError(Exception):
    """Base class of every kimi-vl error."""


class ConfigError(KimiVLError, ValueError):
    """A configuration is inconsistent (e.g. invalid `layer_types`, top-k larger than the expert count)."""


class ShapeError(KimiVLError, ValueError):
    """Tensors passed to a kernel or layer have incompatible shapes; the message names them."""


class InvalidMediaError(KimiVLError, ValueError):
    """An image or video cannot be read, or media and placeholder tokens do not match."""


class CheckpointError(KimiVLError, OSError):
    """A checkpoint directory is missing, incomplete, or not of the expected kind."""


class TrainingDivergedError(KimiVLError, RuntimeError):
    """Training produced non-finite losses or gradients for too many steps in a row."""


class TrainingInterrupted(KimiVLError):
    """A run stopped on SIGINT or SIGTERM, or at its time limit, after writing a checkpoint
    (`kimi_vl.training.stop`); the message names the step and says how to resume. `exit_status`: what `kimi-vl`
    exits with (128 + the signal's number, as a process the signal ended: 130 for SIGINT, 143 for SIGTERM; 124, as
    `timeout` does, for the time limit)."""

    def __init__(self, message: str, exit_status: int = 130) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class DataLoaderWorkerError(KimiVLError, RuntimeError):
    """A data-loader process ended before its run did (killed by a signal, or by the system for want of memory)."""


class DataUnavailableError(KimiVLError, OSError):
    """Benchmark data could not be loaded from the hub or from the given local directory; the message says
    which files are expected where."""


class DataError(KimiVLError, ValueError):
    """Training data cannot be used: a source that cannot be read, too many bad records in a row, a bad record
    under `--strict`, or data that changed since the run's checkpoint."""


class BadRecordError(DataError):
    """One record of a data source is unusable. `reason` says why, `file` and `row` where (when known); the
    message is `FILE:ROW: reason`."""

    def __init__(self, reason: str, file: str | None = None, row: int | str | None = None) -> None:
        self.reason, self.file, self.row = reason, file, row
        where = f"{file}:{row}: " if file is not None and row is not None else f"{file}: " if file else ""
        super().__init__(where + reason)

    def __reduce__(self):  # picklable across data-loader worker processes
        return (type(self), (self.reason, self.file, self.row))


def hub_id_hint(path: str | os.PathLike) -> str:
    """A sentence for an error about the local folder `path` that does not exist, when it reads as a Hugging Face
    Hub id (`org/name`): how to download it first. Empty otherwise."""
    parts = PurePath(path).parts
    if len(parts) != 2 or os.path.isabs(path) or os.path.exists(path):
        return ""
    return (f" `{'/'.join(parts)}` is not a local folder; to use it from the Hugging Face Hub, download it first "
            f"(`huggingface-cli download {'/'.join(parts)} --local-dir DIR`) and pass DIR.")


def read_config_file(config_file: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in a checkpoint's `config.json`; `CheckpointError` naming the file when it cannot be read
    or holds something else."""
    try:
        raw = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_file} cannot be read as JSON ({exc}); restore the checkpoint's config.json "
                              "(save_pretrained writes it) or point at another checkpoint.") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} holds a JSON {type(raw).__name__}, not a model config object; restore "
                              "the checkpoint's config.json or point at another checkpoint.")
    return raw
