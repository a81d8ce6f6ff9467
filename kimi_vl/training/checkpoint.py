"""Atomic, resumable training-state checkpoints.

A checkpoint is a directory `step_XXXXXXXX/` holding `model.safetensors` (every parameter and persistent buffer,
router biases included), `optimizer.pt`, `rng.pt` and `trainer_state.json`. It is written under a temporary name in
the same parent directory and renamed into place only once every file is written and flushed, so a crash mid-write
leaves a `*.tmp-*` directory that `latest_checkpoint` ignores, never a half-written `step_*` one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from ..errors import CheckpointError

STATE_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], keep: int | None = 2) -> Path:
    """Write `root/step_{step:08d}` atomically; keep only the newest `keep` checkpoints (None keeps all)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    for name in STATE_FILES:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary directories of interrupted writes excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and ".tmp" not in p.name
             and all((p / name).is_file() for name in STATE_FILES)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG state from a checkpoint directory; return its `trainer_state.json`."""
    path = Path(path)
    missing = [name for name in STATE_FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path} is not a complete training checkpoint (missing {', '.join(missing)}); "
                              "pass a step_* directory written by save_checkpoint.")
    load_model(model, str(path / "model.safetensors"), strict=True)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())
