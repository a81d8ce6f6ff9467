"""A stage under `accelerate launch --use_fsdp --fsdp_version 2` (2 gloo processes, accelerate's FSDP2 path forced on
CPUs by `tests.training.fsdp2_cpu`) against one process on the same global batch: accelerate's loading from rank 0
(the launcher's default) is not used, training-state checkpoints and the final checkpoint hold the full tensors
(gathered on every rank, written by rank 0), and a run stopped after a step resumes from its checkpoint's shards."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_vl.training.stages import load_checkpoint_dir
from kimi_vl.training.trainer import read_metrics
from tests.training.launch import free_port, run, torchrun

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "3", "--rows", "2", "--seq-len", "64", "--tokenizer-texts", "100", "--vocab-size", "400",
         "--checkpoint-every", "1", "--no-progress"]


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


# what `accelerate launch --use_fsdp --fsdp_version 2` puts in the ranks' environment (its defaults)
FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
         "FSDP_SYNC_MODULE_STATES": "true"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_pretrain_stops_resumes_and_saves_the_single_process_model(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run([sys.executable, "-m", "kimi_vl.cli", "train", "pretrain", "--out", str(one), *SMALL, "--grad-accum", "2"],
        _env())
    command = [sys.executable, "-m", "tests.training.fsdp2_cpu", "train", "pretrain", "--out", str(two), *SMALL]
    stopped = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                              str(free_port()), *command[1:], "--max-minutes", "1e-6"], env=_env(**FSDP2),
                             capture_output=True, text=True, timeout=300)
    assert "time limit of 1e-06 min: stopped after step 1 of 3" in stopped.stderr, stopped.stderr[-4000:]
    assert [p.name for p in (two / "state").iterdir()] == ["step_00000001"]
    torchrun(command, _env(**FSDP2))
    a, b = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] and x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    assert b[-1]["val_loss"] == pytest.approx(a[-1]["val_loss"], rel=1e-5)
    for name in ("model.safetensors", "state/step_00000003/model.safetensors"):
        want, got = load_file(one / name), load_file(two / name)
        assert got.keys() == want.keys(), name
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=f"{name}: {key}")
    model, _ = load_checkpoint_dir(two)  # from_pretrained, plain tensors
    assert not any(type(p) is not torch.nn.Parameter for p in model.parameters())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_rl_with_a_text_only_rank_equals_one_process(tmp_path):
    """RL's rank 0 rolls out the text family's prompts, rank 1 the vision family's: under FSDP2 every rank still runs
    the vision tower in every forward (the shards' collectives pair up), and the update is the single process's."""
    from kimi_vl.training.presets import get_preset
    from kimi_vl.training.stages import build_model, build_processor

    start, one, two = tmp_path / "start", tmp_path / "one", tmp_path / "two"
    preset = get_preset("tiny")
    processor = build_processor(preset.data["pretrain"])
    torch.manual_seed(0)
    build_model(preset, processor).save_pretrained(start)
    processor.save_pretrained(start)
    args = ["train", "rl", "--from", str(start), "--steps", "2", "--prompts-per-family", "2", "--k", "2",
            "--max-new-tokens", "6", "--no-progress"]
    run([sys.executable, "-m", "kimi_vl.cli", *args, "--out", str(one)], _env())
    torchrun([sys.executable, "-m", "tests.training.fsdp2_cpu", *args, "--out", str(two)], _env(**FSDP2))
    a, b = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["tokens"] == y["tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7)
    want, got = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
