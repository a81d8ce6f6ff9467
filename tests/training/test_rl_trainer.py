"""RL on the one training loop (`Trainer` + `RLStep`): two gloo processes equal one on the same global batch, SIGKILL
and rerun reproduces the uninterrupted run exactly, bf16 autocast on CPU, off-policy updates, and the RL stage's
checkpoints taken only at rollout-batch boundaries (a stop signal's too)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kimi_vl.errors import TrainingInterrupted
from kimi_vl.training.checkpoint import list_checkpoints
from kimi_vl.training.presets import get_preset
from kimi_vl.training.rl import RLStep
from kimi_vl.training.stages import build_model, build_processor, load_checkpoint_dir, read_summary, rl
from kimi_vl.training.trainer import read_metrics
from tests.training.launch import finish, run, run_together, start, torchrun_command

ROOT = Path(__file__).resolve().parents[2]
RL_ARGS = ["--prompts-per-family", "2", "--k", "2", "--max-new-tokens", "6", "--no-progress"]
STABLE = ("loss", "reward_mean", "masked_fraction", "log_ratio_abs_mean", "grad_norm", "tokens", "rollout")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untrained `tiny` model with its processor, saved as a stage would (RL needs no trained model to be
    compared with itself)."""
    out = tmp_path_factory.mktemp("rl") / "start"
    preset = get_preset("tiny")
    processor = build_processor(preset.data["pretrain"])
    torch.manual_seed(0)
    model = build_model(preset, processor)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _command(start: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kimi_vl.cli", "train", "rl", "--from", str(start), "--out", str(out),
            *RL_ARGS, *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _stable(out: Path) -> list[dict]:
    return [{k: m.get(k) for k in (*STABLE, "step")} for m in read_metrics(out / "metrics.jsonl")]


def _assert_same_weights(a_dir: Path, b_dir: Path, atol: float) -> None:
    a, _ = load_checkpoint_dir(a_dir)
    b, _ = load_checkpoint_dir(b_dir)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=name)


def test_two_processes_equal_one_on_the_same_global_batch(checkpoint, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo; each rank rolls out half of the 4 prompts) against one process: the same
    responses and rewards (seeded per prompt, not per process), losses and updated weights to 1e-5, the router biases
    included: each rank pads its micro-batches to its own longest response, and only real tokens count in the
    all-reduced expert loads (when padding counted, a sign step flipped at a near-tie on these prompts)."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("--steps", "2")
    run_together(_command(checkpoint, one, *args), torchrun_command(_command(checkpoint, two, *args)), env=_env())
    a, b = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["tokens"] == y["tokens"]
        assert x["response_length"] == y["response_length"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7)
    _assert_same_weights(one, two, atol=1e-5)


def test_sigkill_then_rerun_reproduces_the_uninterrupted_run(checkpoint, tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    args = ("--steps", "4", "--checkpoint-every", "1")
    uninterrupted = start(_command(checkpoint, reference, *args), _env())  # beside the killed run: it is independent
    proc = subprocess.Popen(_command(checkpoint, killed, *args), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "state" / "step_00000002").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "training_summary.json").exists()
    finish(uninterrupted)
    run(_command(checkpoint, killed, *args), _env())
    assert _stable(killed) == _stable(reference)
    _assert_same_weights(killed, reference, atol=0)


def test_off_policy_updates_bf16_autocast_and_checkpoint_boundaries(checkpoint, tmp_path):
    """Two updates per rollout batch: the second sees a log-ratio (the K2.5 mask and penalty act) and reuses the
    batch; checkpoints fall only on rollout-batch boundaries; the whole step runs under bf16 autocast on CPU."""
    out = rl(checkpoint, tmp_path / "rl", steps=3, updates_per_batch=2, checkpoint_every=1, precision="bf16",
             prompts_per_family=1, k=2, max_new_tokens=4, progress=False)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["rollout"] for m in metrics] == [0, 0, 1]
    assert metrics[0]["log_ratio_abs_mean"] < metrics[1]["log_ratio_abs_mean"]
    assert "entropy" in metrics[0] and "entropy" not in metrics[1] and "entropy" in metrics[2]
    assert metrics[0]["reward_mean"] == metrics[1]["reward_mean"]
    assert all(m["loss"] == m["loss"] for m in metrics)  # finite under bf16
    steps = [p.name for p in list_checkpoints(out / "state")]
    assert steps == ["step_00000002", "step_00000003"]  # step 1 is mid-batch; the last step is always saved
    summary = read_summary(out)
    assert summary["updates_per_batch"] == 2 and summary["steps"] == 3
    assert json.loads((out / "run_config.json").read_text())["train"]["precision"] == "bf16"


def _sigterm_at(monkeypatch, step: int):
    """`RLStep.backward` sending this process a SIGTERM when computing optimizer step `step` (0-based); returns the
    original."""
    backward = RLStep.backward

    def signalled(self, trainer):
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return backward(self, trainer)

    monkeypatch.setattr(RLStep, "backward", signalled)
    return backward


def test_a_stop_signal_mid_batch_stops_at_the_rollout_batch_end(checkpoint, tmp_path, monkeypatch):
    """SIGTERM in the first update of a rollout batch: the run stops after the batch's second update, where a resume
    can start, and not in the middle of it."""
    _sigterm_at(monkeypatch, 0)
    kwargs = dict(steps=4, updates_per_batch=2, checkpoint_every=100, prompts_per_family=1, k=2, max_new_tokens=4,
                  progress=False)
    with pytest.raises(TrainingInterrupted, match="SIGTERM: stopped after step 2 of 4"):
        rl(checkpoint, tmp_path / "rl", **kwargs)
    assert [p.name for p in list_checkpoints(tmp_path / "rl" / "state")] == ["step_00000002"]
    assert [m["step"] for m in read_metrics(tmp_path / "rl" / "metrics.jsonl")] == [1, 2]


def test_a_stop_signal_in_the_last_step_stops_the_stage(checkpoint, tmp_path, monkeypatch):
    """SIGTERM in the last step, mid rollout batch (3 steps, 2 updates per batch): the stage stops with the last
    step's checkpoint instead of finishing, so that `kimi-vl ablate vision-rl` (a run per arm and seed) does not go
    on to its next RL run after announcing the stop; the rerun only writes the checkpoint directory."""
    backward = _sigterm_at(monkeypatch, 2)
    kwargs = dict(steps=3, updates_per_batch=2, checkpoint_every=100, prompts_per_family=1, k=2, max_new_tokens=4,
                  progress=False)
    with pytest.raises(TrainingInterrupted, match="SIGTERM: stopped after step 3 of 3"):
        rl(checkpoint, tmp_path / "rl", **kwargs)
    assert [p.name for p in list_checkpoints(tmp_path / "rl" / "state")] == ["step_00000003"]
    assert read_summary(tmp_path / "rl") is None
    monkeypatch.setattr(RLStep, "backward", backward)
    rl(checkpoint, tmp_path / "rl", **kwargs)
    assert read_summary(tmp_path / "rl")["complete"]
    assert [m["step"] for m in read_metrics(tmp_path / "rl" / "metrics.jsonl")] == [1, 2, 3]


def test_grpo_kl_is_to_the_from_checkpoint(checkpoint, tmp_path):
    """`kimi-vl train rl --algorithm grpo --kl-coef 0.01` holds the --from checkpoint fixed as GRPO's reference (it
    crashed at the first rollout batch, telling the user to "pass ref_model to rollout"): the first update starts
    at the reference (KL 0, the loss of kl_coef 0), the second, from a moved policy, adds a positive KL term.
    `RLStep` without a reference refuses kl_coef > 0 before any rollout."""
    from kimi_vl.errors import ConfigError
    from kimi_vl.training.rl import RLConfig

    runs = {}
    for kl in (0.0, 0.01):
        out = rl(checkpoint, tmp_path / f"kl{kl}", steps=2, algorithm="grpo", kl_coef=kl, k=2, prompts_per_family=1,
                 max_new_tokens=4, progress=False)
        runs[kl] = [m["loss"] for m in read_metrics(out / "metrics.jsonl")]
    assert runs[0.01][0] == pytest.approx(runs[0.0][0], abs=1e-7) and runs[0.01][1] > runs[0.0][1]
    with pytest.raises(ConfigError, match="needs a reference model"):
        RLStep(lambda i: ([], []), None, RLConfig(algorithm="grpo", kl_coef=0.01), seed=0)


def test_rl_on_users_rows_logs_the_prompts_drawn_per_source(checkpoint, tmp_path):
    """metrics.jsonl's `documents` (drawn per source, next to `bad_records`) was missing from RL steps: a mixture of
    RL sources could not be checked. Each rollout batch logs them on its first update."""
    for name, n in (("a", 5), ("b", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(n)))
    out = rl(checkpoint, tmp_path / "rl", sources=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], steps=4,
             k=2, prompts_per_step=4, max_new_tokens=2, updates_per_batch=2, progress=False)
    drawn = [m.get("documents") for m in read_metrics(out / "metrics.jsonl")]
    assert drawn[1] is None and drawn[3] is None  # the second update of a rollout batch draws nothing
    assert all(sum(d.values()) == 4 and set(d) <= {str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")}
               for d in (drawn[0], drawn[2]))
