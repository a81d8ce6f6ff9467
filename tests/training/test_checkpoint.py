"""Training-state checkpoints: exact optimizer and RNG round trips without pickles, a manifest that catches damaged
files, resume falling back past a damaged newest checkpoint, and pickles in a checkpoint folder never loaded."""

import json
import random
import shutil

import numpy as np
import pytest
import torch

from kimi_vl.errors import CheckpointError
from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.training import checkpoint as ckpt
from kimi_vl.training.muonclip import MuonClip
from kimi_vl.training.trainer import Trainer, read_metrics
from tests.training.test_trainer import CountingData, cfg, tiny_lm

OPTIMIZERS = {"muonclip": lambda m: MuonClip(m, lr=1e-2), "adamw": lambda m: torch.optim.AdamW(m.parameters(), 1e-2)}


def _train_steps(model, optimizer, steps, start=0):
    data = CountingData()
    for i in range(start, start + steps):
        batch = data.batch(i)
        optimizer.zero_grad()
        model(**batch.model_inputs()).loss.backward()
        optimizer.step()


def _assert_same_state(a, b, where="state"):
    """Equal nested optimizer state: same types (tuples stay tuples), tensors equal in value, dtype and shape."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_and_rng_round_trip_exactly(tmp_path, kind):
    model = tiny_lm()
    optimizer = OPTIMIZERS[kind](model)
    _train_steps(model, optimizer, 2)
    random.seed(3)
    np.random.seed(4)
    path = ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, trainer_state={"tokens": 7})
    assert sorted(p.name for p in path.iterdir()) == sorted((*ckpt.STATE_FILES, ckpt.MANIFEST))
    draws = (random.random(), np.random.rand(), torch.rand(3))

    restored = tiny_lm(seed=5)
    restored_optimizer = OPTIMIZERS[kind](restored)
    assert ckpt.load_checkpoint(path, model=restored, optimizer=restored_optimizer) == {"step": 2, "tokens": 7}
    assert draws[0] == random.random() and draws[1] == np.random.rand() and torch.equal(draws[2], torch.rand(3))
    _assert_same_state(optimizer.state_dict(), restored_optimizer.state_dict())
    _train_steps(model, optimizer, 2, start=2)  # and both continue identically
    _train_steps(restored, restored_optimizer, 2, start=2)
    for (name, p), q in zip(model.named_parameters(), restored.parameters()):
        assert torch.equal(p, q), name


def test_a_checkpoint_of_another_model_is_a_checkpoint_error(tmp_path):
    """Resuming into a model of other sizes names the mismatch and what to do (it was torch's RuntimeError)."""
    model = tiny_lm()
    path = ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=MuonClip(model, lr=1e-2), trainer_state={})
    other = KimiTextForCausalLM(KimiTextConfig(**{**model.config.to_diff_dict(), "hidden_size": 48}))
    with pytest.raises(CheckpointError, match=r"another model than this run builds \(.*size mismatch.*settings it was"):
        ckpt.load_checkpoint(path, model=other, optimizer=MuonClip(other, lr=1e-2))


def _damage(path, how):
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:  # one byte flipped, same size
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("optimizer,how,name", [("muonclip", "truncated", "model.safetensors"),
                                                 ("adamw", "altered", "optimizer.safetensors")])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, optimizer, how, name):
    config = cfg(steps=6, checkpoint_every=2, optimizer=optimizer)
    Trainer(tiny_lm(), CountingData(), config, tmp_path).train()
    reference = read_metrics(tmp_path / "metrics.jsonl")
    state = tmp_path / "state"
    assert [p.name for p in ckpt.list_checkpoints(state)] == ["step_00000004", "step_00000006"]
    _damage(state / "step_00000006" / name, how)

    with pytest.warns(UserWarning, match=rf"skipping the training checkpoint step_00000006: .*{name}"):
        resumed = Trainer(tiny_lm(seed=9), CountingData(), config, tmp_path)
        resumed.train()
    got = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, 7))
    for a, b in zip(reference, got):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["max_logits"] == b["max_logits"]
    assert [p.name for p in ckpt.list_checkpoints(state)] == ["step_00000004", "step_00000006"]
    ckpt.verify_checkpoint(state / "step_00000006")  # rewritten by the resumed run


def test_no_verified_checkpoint_stops_naming_the_bad_files(tmp_path):
    model = tiny_lm()
    optimizer = OPTIMIZERS["adamw"](model)
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=optimizer, trainer_state={})
    _damage(tmp_path / "step_00000002" / "rng.json", "truncated")
    (tmp_path / "step_00000001" / ckpt.MANIFEST).write_text(json.dumps({"format": ckpt.FORMAT, "version": 2}))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as info:
        ckpt.latest_checkpoint(tmp_path)
    message = str(info.value)
    assert "step_00000002/rng.json has" in message and "truncated" in message
    assert "step_00000001/manifest.json is not a valid checkpoint manifest" in message
    with pytest.raises(CheckpointError, match="rng.json"):
        ckpt.load_checkpoint(tmp_path / "step_00000002", model=model, optimizer=optimizer)
    assert ckpt.latest_checkpoint(tmp_path / "nothing here") is None



def test_the_next_checkpoint_removes_writes_a_killed_process_left(tmp_path, monkeypatch):
    """A process killed mid-write leaves a `step_*.tmp-PID` folder (a model's size and more); the run that resumes
    removes it with its first checkpoint instead of letting each kill add one to the disk."""
    model = tiny_lm()
    optimizer = OPTIMIZERS["adamw"](model)
    ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, trainer_state={})

    def killed(tensors, filename, *a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ckpt, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 4, model=model, optimizer=optimizer, trainer_state={})
    monkeypatch.undo()
    (tmp_path / "step_00000004.tmp-1").mkdir()  # the same, left by another process
    assert len(list(tmp_path.glob("step_00000004.tmp-*"))) == 2

    ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, trainer_state={}, keep=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]

class _WritesMarker:
    """A pickle that creates a file when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickles_in_a_checkpoint_folder_are_never_loaded(tmp_path):
    marker = tmp_path / "unpickled"
    model = tiny_lm()
    optimizer = OPTIMIZERS["adamw"](model)
    good = ckpt.save_checkpoint(tmp_path / "state", 2, model=model, optimizer=optimizer, trainer_state={})
    # An old-format checkpoint (optimizer.pt / rng.pt pickles, no manifest) beside and above it is refused...
    old = tmp_path / "state" / "step_00000004"
    shutil.copytree(good, old)
    for name in ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json"):
        (old / name).unlink()
    (old / ckpt.MANIFEST).unlink()
    for name in ckpt.PICKLE_FILES:
        torch.save(_WritesMarker(marker), old / name)
    with pytest.raises(CheckpointError, match="old format"):
        ckpt.load_checkpoint(old, model=model, optimizer=optimizer)
    with pytest.warns(UserWarning, match="old format"):
        assert ckpt.latest_checkpoint(tmp_path / "state") == good
    # ... and a pickle dropped into a verified checkpoint is ignored.
    torch.save(_WritesMarker(marker), good / "optimizer.pt")
    ckpt.load_checkpoint(good, model=model, optimizer=optimizer)
    assert not marker.exists()
    torch.load(good / "optimizer.pt", weights_only=False)  # the payload is live: loading it would have run it
    assert marker.exists()


def _sharded_lm(seed: int):
    """`tiny_lm(seed)` under FSDP2 on the current one-rank mesh (mixers, FFNs and the root: DTensor parameters)
    with its MuonClip, built after sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_lm(seed)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer.self_attn, mesh=mesh)
        fully_shard(layer.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, MuonClip(model, lr=1e-2)


def test_fsdp2_sharded_state_round_trips_as_full_tensors(tmp_path):
    """Parameters and optimizer states that are DTensors (FSDP2) are written as their full tensors, as one unsharded
    process writes them, and loaded back into the shards: a sharded run resumed from its checkpoint, and an
    unsharded model loading it, continue exactly as the uninterrupted run."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, optimizer = _sharded_lm(0)
        _train_steps(model, optimizer, 2)
        path = ckpt.save_checkpoint(tmp_path / "state", 2, model=model, optimizer=optimizer, trainer_state={})
        stored = ckpt.load_file(str(path / "model.safetensors"))
        assert stored.keys() == model.state_dict().keys()
        assert all(type(t) is torch.Tensor and torch.equal(t, full(model.state_dict()[k])) for k, t in stored.items())

        restored, restored_optimizer = _sharded_lm(5)
        ckpt.load_checkpoint(path, model=restored, optimizer=restored_optimizer)
        plain = tiny_lm(seed=5)
        plain_optimizer = MuonClip(plain, lr=1e-2)
        ckpt.load_checkpoint(path, model=plain, optimizer=plain_optimizer)
        for m, opt in ((model, optimizer), (restored, restored_optimizer), (plain, plain_optimizer)):
            _train_steps(m, opt, 1, start=2)
        want = {k: full(v) for k, v in model.state_dict().items()}
        for other, atol in ((restored, 0), (plain, 1e-6)):  # unsharded: other fp32 rounding in the matmuls' splits
            for k, v in other.state_dict().items():
                torch.testing.assert_close(full(v), want[k], rtol=0, atol=atol, msg=k)
    finally:
        dist.destroy_process_group()
