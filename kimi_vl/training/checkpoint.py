"""Atomic, verified, resumable training-state checkpoints that never unpickle anything.

A checkpoint is a directory `step_XXXXXXXX/` holding

- `model.safetensors`: every parameter and persistent buffer (router biases included);
- `optimizer.safetensors` + `optimizer.json`: the optimizer's `state_dict()`, its tensors in safetensors and the
  rest (param_groups, non-tensor state) as a JSON skeleton that names them (see `encode_state`);
- `rng.safetensors` + `rng.json`: the torch (and CUDA) generator states as uint8 tensors, Python's `random` and
  numpy's legacy generator states as JSON;
- `trainer_state.json`: the step and the trainer's counters;
- `manifest.json`, written last: the name, size and sha256 of every other file.

The directory is written under a temporary name in the same parent and renamed into place only once every file is
written and flushed, so a crash mid-write leaves a `*.tmp-*` directory that is never loaded (the next checkpoint
written under the same parent removes it). Loading reads only safetensors and JSON, and only after the manifest
verifies (`verify_checkpoint`); `latest_checkpoint` takes the newest checkpoint that verifies and warns about each
newer one it skips (truncated, altered, or of the old pickle format), and raises `CheckpointError` when none does.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from .distributed import full_state, is_main_process, shard_like

FORMAT = "kimi-vl-training-state"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
STATE_FILES = ("model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json",
               "trainer_state.json")
"""Every file of a checkpoint besides the manifest, which lists them."""
PICKLE_FILES = ("optimizer.pt", "rng.pt")
"""The files of the format before version 2 (pickles: never loaded, since unpickling can run code)."""

_STEP_DIR = re.compile(r"step_(\d+)")
_TAGS = ("__tensor__", "__tuple__", "__dict__", "__ndarray__")


# ------------------------------------------------------------------------------------------ state <-> JSON + tensors
def encode_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-serialisable skeleton of `obj` (nested dicts, lists, tuples, numbers, strings, None, tensors, numpy
    arrays); each tensor is moved to the CPU into `tensors` under its path (`state/3/exp_avg`) and replaced by
    `{"__tensor__": path}`. Tuples, numpy arrays and dicts whose keys are not plain strings are tagged so that
    `decode_state` restores them exactly (an optimizer's integer state keys, AdamW's `betas` tuple).

    Raises:
        CheckpointError: `obj` holds a value of another type (the message names its path).
    """
    if isinstance(obj, torch.Tensor):
        key, n = path, 0
        while key in tensors:  # paths are unique unless a dict key holds a "/"
            n += 1
            key = f"{path}#{n}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, tensors, _join(path, i)) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_state(v, tensors, _join(path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: encode_state(v, tensors, _join(path, k)) for k, v in obj.items()}
        pairs = [[encode_state(k, tensors, _join(path, f"key{i}")), encode_state(v, tensors, _join(path, k))]
                 for i, (k, v) in enumerate(obj.items())]
        return {"__dict__": pairs}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot store {type(obj).__name__} at {path or 'the top level'} of a training checkpoint "
                          "(only tensors, numpy arrays, numbers, strings, None and lists/tuples/dicts of them).")


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def decode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `encode_state`: rebuild the object from its skeleton and the stored tensors."""
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return np.array(obj["__ndarray__"], dtype=obj["dtype"])
    if "__tuple__" in obj:
        return tuple(decode_state(v, tensors) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {decode_state(k, tensors): decode_state(v, tensors) for k, v in obj["__dict__"]}
    return {k: decode_state(v, tensors) for k, v in obj.items()}


def _save_state(obj: Any, directory: Path, stem: str) -> None:
    """Write `obj` as `stem.safetensors` (its tensors) + `stem.json` (the skeleton)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_state(obj, tensors)
    save_file(tensors, str(directory / f"{stem}.safetensors"))
    (directory / f"{stem}.json").write_text(json.dumps(skeleton))


def _load_state(directory: Path, stem: str) -> Any:
    return decode_state(json.loads((directory / f"{stem}.json").read_text()),
                        load_file(str(directory / f"{stem}.safetensors")))


def rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's (and CUDA's) global generator states, in `encode_state`'s types."""
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


# ------------------------------------------------------------------------------------------------------ manifest
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check that `path` is a complete checkpoint whose files match its manifest (names, sizes, sha256).

    Raises:
        CheckpointError: naming the missing, truncated or altered file, or saying that the directory is of the old
            pickle format or not a checkpoint at all.
    """
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if any((path / name).is_file() for name in PICKLE_FILES):
            raise CheckpointError(
                f"{path} is a training checkpoint of the old format ({', '.join(PICKLE_FILES)}: pickles, which are "
                "never loaded because unpickling runs code from the file); it cannot be resumed. Start the run "
                "again, or move the directory away to resume from an older checkpoint of the new format.")
        raise CheckpointError(f"{path} is not a complete training checkpoint (no {MANIFEST}); pass a step_* "
                              "directory written by save_checkpoint.")
    try:
        manifest = json.loads(manifest_file.read_text())
        if (manifest["format"], manifest["version"]) != (FORMAT, FORMAT_VERSION):
            raise CheckpointError(f"{manifest_file} is not a {FORMAT} version {FORMAT_VERSION} manifest; it was "
                                  "written by another program or version and cannot be resumed.")
        expected = {name: (int(manifest["files"][name]["bytes"]), str(manifest["files"][name]["sha256"]))
                    for name in STATE_FILES}
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_file} is not a valid checkpoint manifest (bad or missing entry {exc}); "
                              "the checkpoint is damaged: delete it.") from exc
    for name, (size, sha256) in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing; the checkpoint is incomplete.")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, its manifest says {size}: the file was "
                                  "truncated or replaced after it was written.")
        if _sha256(file) != sha256:
            raise CheckpointError(f"{file} does not match the sha256 in its manifest: the file was altered or "
                                  "corrupted after it was written.")


# ----------------------------------------------------------------------------------------------- save / find / load
def save_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], keep: int | None = 2) -> Path | None:
    """Write `root/step_{step:08d}` atomically (manifest last) and return it.

    Then keep the newest `keep` checkpoints up to this one (None keeps all); checkpoints of higher steps belong to
    a continuation this run has replaced (it resumed from an earlier one, e.g. past a damaged checkpoint) and are
    removed, and so are the temporary directories of writes that a killed process left.

    Under a process group every rank calls it and rank 0 alone writes (the others return None); parameters and
    optimizer states that are DTensors (FSDP2) are gathered whole first, so the checkpoint is the one a single
    process writes.
    """
    model_state, optimizer_state, main = model.state_dict(), optimizer.state_dict(), is_main_process()
    sharded = any(isinstance(t, DTensor) for t in model_state.values())
    if sharded:
        model_state, optimizer_state = full_state(model_state, main), full_state(optimizer_state, main)
    if not main:
        return None
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if sharded:
        save_file({k: t.contiguous() for k, t in model_state.items()}, str(tmp / "model.safetensors"))
    else:
        save_model(model, str(tmp / "model.safetensors"))
    _save_state(optimizer_state, tmp, "optimizer")
    _save_state(rng_state(), tmp, "rng")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    files = {}
    for name in STATE_FILES:
        _fsync(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    for leftover in root.glob("step_*.tmp-*"):  # half-written by a process killed mid-write: never loadable
        shutil.rmtree(leftover, ignore_errors=True)
    if keep is not None:
        found = list_checkpoints(root)
        older = [p for p in found if checkpoint_step(p) < step]
        stale = older[: max(len(older) - (keep - 1), 0)] + [p for p in found if checkpoint_step(p) > step]
        for old in stale:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_step(path: Path) -> int:
    """The step of a `step_XXXXXXXX` checkpoint directory."""
    return int(_STEP_DIR.fullmatch(path.name).group(1))


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The `step_*` checkpoint directories under `root`, oldest first (unverified; temporary directories of
    interrupted writes excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under `root` that verifies, or None when there is none at all.

    Each newer checkpoint that fails verification is skipped with a warning saying why.

    Raises:
        CheckpointError: there are checkpoints but none verifies (the message names each one's bad file).
    """
    found = list_checkpoints(root)
    problems = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            warnings.warn(f"skipping the training checkpoint {path.name}: {exc}", UserWarning, stacklevel=2)
            continue
        return path
    if problems:
        raise CheckpointError(f"none of the {len(found)} training checkpoints under {root} can be resumed: "
                              + " ".join(problems) + f" Delete {root} to start the run over.")
    return None


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Verify the checkpoint directory `path`, restore model, optimizer and RNG state from it and return its
    `trainer_state.json`. Parameters that are DTensors (FSDP2) take their shards of the stored full tensors, and so
    do their optimizer states.

    Raises:
        CheckpointError: the checkpoint does not verify (see `verify_checkpoint`), or holds another model (other
            sizes or parameter names) than `model`.
    """
    path = Path(path)
    verify_checkpoint(path)
    optimizer_state = _load_state(path, "optimizer")
    current = model.state_dict()
    sharded = any(isinstance(t, DTensor) for t in current.values())
    try:
        if sharded:
            stored = load_file(str(path / "model.safetensors"))
            model.load_state_dict({k: shard_like(t.to(current[k].device), current[k])
                                   if isinstance(current.get(k), DTensor) else t for k, t in stored.items()},
                                  strict=True)
        else:
            load_model(model, str(path / "model.safetensors"), strict=True)
    except (RuntimeError, KeyError) as exc:
        detail = str(exc).strip().splitlines()
        raise CheckpointError(
            f"{path} holds another model than this run builds ({detail[-1].strip() if detail else exc!r}); resume "
            "it with the settings it was trained with (the model's sizes), or write this run to another folder."
        ) from exc
    if sharded:
        params = [p for group in optimizer.param_groups for p in group["params"]]  # the state's integer keys
        for index, state in optimizer_state["state"].items():
            p = params[index]
            for key, value in state.items():
                if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.shape == p.shape:
                    state[key] = shard_like(value.to(p.device, p.dtype), p)
    optimizer.load_state_dict(optimizer_state)
    set_rng_state(_load_state(path, "rng"))
    return json.loads((path / "trainer_state.json").read_text())
