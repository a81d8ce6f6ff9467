"""The trainer: WSD schedule, learning, exact resume, atomic checkpoints, the non-finite guard, stopping on SIGINT /
SIGTERM."""

import json
import math
import os
import signal
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from kimi_vl.errors import CheckpointError, ConfigError, DataError, TrainingDivergedError, TrainingInterrupted
from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.training import checkpoint as ckpt
from kimi_vl.training.config import resolve
from kimi_vl.training.plots import plot_metrics
from kimi_vl.training.trainer import (
    LanguageModelStep,
    TrainConfig,
    Trainer,
    read_metrics,
    unigram_entropy,
    wsd_lr,
)

V = 40


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "labels": self.labels, "cu_seqlens": self.cu_seqlens}

    def to(self, device):
        return self

    num_tokens = property(lambda self: self.input_ids.numel())
    num_vision_tokens = 0


class CountingData:
    """Documents counting upwards mod V from a random start: the next token is learnable, the unigram is not."""

    def __init__(self, seed: int = 0, docs: int = 4, length: int = 16, fail_at: int | None = None):
        self.seed, self.docs, self.length, self.fail_at = seed, docs, length, fail_at

    def batch(self, index: int) -> Batch:
        if index == self.fail_at:
            raise KeyboardInterrupt("simulated kill")
        g = torch.Generator().manual_seed(self.seed * 100003 + index)
        starts = torch.randint(3, V, (self.docs, 1), generator=g)
        ids = 3 + (starts - 3 + torch.arange(self.length)) % (V - 3)
        ids = ids.reshape(1, -1)
        cu = torch.arange(0, self.docs * self.length + 1, self.length, dtype=torch.int32)
        return Batch(ids, ids.clone(), cu)


def tiny_lm(seed: int = 0) -> KimiTextForCausalLM:
    torch.manual_seed(seed)
    return KimiTextForCausalLM(KimiTextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_experts=4,
        num_experts_per_tok=2, kda_head_dim=8, kda_num_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ))


def cfg(**kw) -> TrainConfig:
    base = dict(steps=8, lr=1e-2, warmup_steps=2, checkpoint_every=4, progress=False, val_batches=2)
    return TrainConfig(**{**base, **kw})


def test_wsd_schedule():
    c = TrainConfig(steps=100, lr=1.0, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    lrs = [wsd_lr(s, c) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(lr == 1.0 for lr in lrs[10:80])
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    assert lrs[99] == pytest.approx(0.1)


@pytest.mark.parametrize("steps, warmup, want", [
    (10, 10, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.55, 0.1]),  # the warmup reaches the decay's last steps
    (10, 8, [0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.64, 0.46, 0.28, 0.1]),  # decay_fraction 0.5: from step 5
    (4, 20, [0.05, 0.1, 0.15, 0.1]),  # shorter than its warmup (a trial run of a preset)
])
def test_wsd_schedule_of_a_run_shorter_than_its_warmup_and_decay(steps, warmup, want):
    """Where the warmup and the decay overlap, the rate follows the lower of the two lines, so it still decays to
    `min_lr_ratio * lr` at the last step rather than end at (or leap back from) the warmup's value."""
    c = TrainConfig(steps=steps, lr=1.0, warmup_steps=warmup, decay_fraction=0.5 if warmup == 8 else 0.2,
                    min_lr_ratio=0.1)
    lrs = [wsd_lr(s, c) for s in range(steps)]
    assert lrs == pytest.approx(want)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("setting, value, message", [
    ("max_grad_norm", -1, "max_grad_norm must be > 0 (or none/null to disable clipping), got -1."),
    ("max_grad_norm", 0.0, "max_grad_norm must be > 0 (or none/null to disable clipping), got 0."),
    ("max_grad_norm", NAN, "max_grad_norm must be finite and > 0 (or none/null to disable clipping), got nan."),
    ("lr", NAN, "lr must be finite and > 0, got nan."),
    ("lr", INF, "lr must be finite and > 0, got inf."),
    ("lr", -1e-3, "lr must be > 0, got -0.001."),
    ("weight_decay", NAN, "weight_decay must be finite and >= 0, got nan."),
    ("weight_decay", -1, "weight_decay must be >= 0, got -1."),
    ("router_bias_rate", NAN, "router_bias_rate must be finite and >= 0, got nan."),
    ("qk_clip_tau", -5.0, "qk_clip_tau must be > 0 (or none/null to disable QK-Clip), got -5."),
    ("decay_fraction", NAN, "decay_fraction must be finite and in [0, 1], got nan."),
    ("min_lr_ratio", 1.5, "min_lr_ratio must be in [0, 1], got 1.5."),
    ("max_minutes", INF, "max_minutes must be finite and > 0 (or none/null for no time limit), got inf."),
    ("warmup_steps", -3, "warmup_steps must be an integer >= 0, got -3."),
    ("val_every", -1, "val_every must be an integer >= 0, got -1."),
    ("nan_patience", -1, "nan_patience must be an integer >= 0, got -1."),
    ("steps", 0, "steps must be an integer >= 1, got 0."),
])
def test_settings_out_of_range_are_refused_naming_the_setting_value_and_range(setting, value, message):
    """A NaN, infinite or out-of-range setting would train (to NaN weights, by gradient ascent, or not at all) and
    mark the run complete; it is refused when the configuration is built, whichever optimizer trains."""
    for optimizer in ("muonclip", "adamw"):
        with pytest.raises(ConfigError) as e:
            cfg(optimizer=optimizer, **{setting: value})
        assert str(e.value) == message


def test_none_still_turns_clipping_and_qk_clip_off(tmp_path):
    """`none` / `null` (command line, config file) or None is how clipping and QK-Clip are turned off; it trains."""
    resolved = resolve("sft", "tiny", {"max_grad_norm": "none", "qk_clip_tau": "null"}).train
    assert resolved.max_grad_norm is None and resolved.qk_clip_tau is None
    last = Trainer(tiny_lm(), CountingData(), cfg(steps=2, max_grad_norm=None, qk_clip_tau=None), tmp_path).train()
    assert last["step"] == 2 and math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"])


def test_trainer_learns_and_logs(tmp_path):
    data = CountingData()
    trainer = Trainer(tiny_lm(), data, cfg(steps=30, lr=2e-2), tmp_path, val_data=CountingData(seed=1))
    last = trainer.train()
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 31))
    baseline = unigram_entropy(data)
    assert baseline > 3.0  # ~log(37): counting from a random start is uniform over tokens
    assert last["val_loss"] < 0.6 * baseline and metrics[-1]["loss"] < metrics[0]["loss"] - 1.0
    mla = [k for k in metrics[-1]["max_logits"]]
    assert mla == ["model.layers.3.self_attn"]  # the one MLA layer of the 3:1 hybrid, recorded every step
    # first_k_dense=1: layers 1-3 are MoE
    assert len(metrics[-1]["expert_load"]) == 3 and all(v >= 1.0 for v in metrics[-1]["expert_load"].values())
    paths = plot_metrics(metrics, tmp_path / "plots", baseline=baseline)
    assert {p.name for p in paths} == {"loss.png", "max_logits.png", "grad_norm.png", "expert_load.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_resume_reproduces_the_uninterrupted_curve(tmp_path):
    full = tmp_path / "full"
    Trainer(tiny_lm(), CountingData(), cfg(grad_accum=2), full).train()
    reference = read_metrics(full / "metrics.jsonl")

    cut = tmp_path / "cut"
    killed = CountingData(fail_at=2 * 6)  # dies in step 7, after the step-4 checkpoint
    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny_lm(), killed, cfg(grad_accum=2), cut).train()
    assert len(read_metrics(cut / "metrics.jsonl")) == 6
    assert [p.name for p in ckpt.list_checkpoints(cut / "state")] == ["step_00000004"]
    with pytest.raises(ConfigError, match="checkpoint at step 4, past this run's 3 steps"):
        Trainer(tiny_lm(), CountingData(), cfg(grad_accum=2, steps=3), cut).train()
    resumed = Trainer(tiny_lm(seed=123), CountingData(), cfg(grad_accum=2), cut)  # other init: state must win
    resumed.train()
    got = read_metrics(cut / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, 9))
    for a, b in zip(reference, got):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["max_logits"] == b["max_logits"]
    for (name, p), q in zip(resumed.raw_model.named_parameters(), tiny_lm().parameters()):
        assert p.shape == q.shape, name


def test_a_run_resumed_at_its_end_returns_its_last_step(tmp_path):
    """`train()` again (a notebook cell rerun, or a stage stopped after its last checkpoint but before writing its
    summary) trains nothing and returns the last step's record, as the run did, not an empty summary."""
    trainer = Trainer(tiny_lm(), CountingData(), cfg(steps=3), tmp_path)
    last = trainer.train()
    assert last["step"] == 3 and last == read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert trainer.train() == last
    assert Trainer(tiny_lm(), CountingData(), cfg(steps=3), tmp_path).train() == last
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3



def test_a_metrics_line_cut_short_by_a_crash_does_not_block_the_resume(tmp_path):
    """A crash while a metrics line is written (a full disk, a power cut) leaves it torn: the resume drops it with
    the other steps after its checkpoint, instead of failing on it with a JSONDecodeError."""
    Trainer(tiny_lm(), CountingData(), cfg(steps=4), tmp_path / "full").train()
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):  # killed in step 3, after the step-2 checkpoint
        Trainer(tiny_lm(), CountingData(fail_at=2), cfg(steps=4, checkpoint_every=1), cut).train()
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 3.1')
    Trainer(tiny_lm(), CountingData(), cfg(steps=4), cut).train()
    got, want = read_metrics(cut / "metrics.jsonl"), read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [(m["step"], m["loss"]) for m in got] == [(m["step"], m["loss"]) for m in want]
    assert sorted(p.name for p in cut.iterdir() if p.is_file()) == ["metrics.jsonl"]

class FailingData(CountingData):
    def batch(self, index: int) -> Batch:
        if index == 2:
            raise DataError("a bad record")
        return super().batch(index)


def test_a_run_that_fails_closes_its_progress_bar(tmp_path, monkeypatch):
    """A run that stops on an error (here the data's, in step 3) closes its bar like one that ends: left open (the
    error's traceback keeps it alive in a notebook) it would push the next run's bar down a line."""
    from tqdm.auto import tqdm

    import kimi_vl.progress

    monkeypatch.setattr(kimi_vl.progress, "interactive", lambda stream=None: True)  # a terminal: a tqdm bar
    with pytest.raises(DataError):  # (pytest keeps the traceback, as a notebook does)
        Trainer(tiny_lm(), FailingData(), cfg(progress=True), tmp_path, desc="failing run").train()
    assert not [bar for bar in tqdm._instances if bar.desc == "failing run"]


@pytest.mark.parametrize("first, then", [("muonclip", "adamw"), ("adamw", "muonclip")])
def test_resuming_with_another_optimizer_is_a_checkpoint_error(tmp_path, first, then):
    """A run stopped with a checkpoint and resumed with the other optimizer cannot take over its state: a
    CheckpointError says which optimizer the run had, rather than torch's ValueError about parameter groups."""
    with pytest.raises(TrainingInterrupted):
        Trainer(tiny_lm(), CountingData(), cfg(optimizer=first, max_minutes=1e-6), tmp_path).train()
    with pytest.raises(CheckpointError, match=rf"holds the state of a {first} run, and this run trains with {then}; "
                                              rf"resume it with optimizer='{first}'"):
        Trainer(tiny_lm(), CountingData(), cfg(optimizer=then), tmp_path).train()
    assert Trainer(tiny_lm(), CountingData(), cfg(optimizer=first), tmp_path).train()["step"] == 8


class UnevenData(CountingData):
    """Micro-batches of uneven weight: even indices keep labels on the last 2 tokens of each document (token
    normalisation) or on one document only (document normalisation), odd ones on every token of every document."""

    def __init__(self, per_document: bool):
        super().__init__()
        self.per_document = per_document

    def batch(self, index: int) -> Batch:
        b = super().batch(index)
        if index % 2 == 0:
            labels = torch.full_like(b.labels, -100)
            keep = [slice(0, self.length)] if self.per_document else [
                slice(e - 2, e) for e in b.cu_seqlens[1:].tolist()]
            for k in keep:
                labels[:, k] = b.labels[:, k]
            b.labels = labels
        return b


class MergedData:
    """Micro-batches `2i` and `2i + 1` of `data` packed into one batch `i`."""

    def __init__(self, data: UnevenData):
        self.data = data

    def batch(self, index: int) -> Batch:
        a, b = self.data.batch(2 * index), self.data.batch(2 * index + 1)
        return Batch(torch.cat([a.input_ids, b.input_ids], 1), torch.cat([a.labels, b.labels], 1),
                     torch.cat([a.cu_seqlens, b.cu_seqlens[1:] + a.cu_seqlens[-1]]))


@pytest.mark.parametrize("normalisation", ["token", "document"])
def test_accumulated_micro_batches_train_as_one_batch_of_their_targets(tmp_path, normalisation):
    """With `grad_accum` the step's loss is the mean over all its micro-batches' targets (or documents), as if
    they were one batch, not the mean of each micro-batch's mean: a micro-batch with few targets does not weigh as
    much as one with many."""
    per_document = normalisation == "document"
    settings = dict(steps=2, loss_normalisation=normalisation, max_grad_norm=None)
    Trainer(tiny_lm(), UnevenData(per_document), cfg(grad_accum=2, **settings), tmp_path / "accumulated").train()
    Trainer(tiny_lm(), MergedData(UnevenData(per_document)), cfg(**settings), tmp_path / "one").train()
    for a, b in zip(read_metrics(tmp_path / "accumulated" / "metrics.jsonl"),
                    read_metrics(tmp_path / "one" / "metrics.jsonl")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


class LoggedData(CountingData):
    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def batch(self, index: int) -> Batch:
        self.seen.append(index)
        return super().batch(index)


def test_a_run_resumed_with_another_grad_accum_goes_on_after_the_batches_drawn(tmp_path):
    """Resumed with another `grad_accum` (or number of processes), training neither repeats nor skips data: it draws
    the batches after those the checkpoint's steps drew (step 4 of 2 micro-batches: 0-7), not from its own step's
    index (4-7 again)."""
    first, then = LoggedData(), LoggedData()
    Trainer(tiny_lm(), first, cfg(grad_accum=2, steps=4, checkpoint_every=2), tmp_path).train()
    assert first.seen == list(range(8))
    Trainer(tiny_lm(), then, cfg(grad_accum=1, steps=6, checkpoint_every=2), tmp_path).train()
    assert then.seen == [8, 9]


def test_activation_checkpointing_recomputes_every_sublayer_and_keeps_the_numbers(tmp_path, monkeypatch):
    """`activation_checkpointing=True`: every token mixer and feed-forward, and Block AttnRes's depth mixing, run
    through `torch.utils.checkpoint` in every forward, and on the CPU the run's losses, gradient norms, max logits,
    expert loads and weights equal the run's without it, bit for bit."""
    import transformers.modeling_utils

    off = Trainer(tiny_lm(), CountingData(), cfg(), tmp_path / "off")
    off.train()
    real, calls = transformers.modeling_utils.checkpoint, []
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint",
                        lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))
    on = Trainer(tiny_lm(), CountingData(), cfg(activation_checkpointing=True), tmp_path / "on")
    on.train()
    # per step: every sublayer (4 layers x 2), and Block AttnRes's depth mixing: phase 1 per block (sublayers 1-5,
    # 6-7), phase 2 per reading sublayer (1-7)
    assert Counter(fn.__name__ for fn in calls) == {"attention": 8 * 4, "feed_forward": 8 * 4, "_phase1": 8 * 2,
                                                    "_phase2": 8 * 7}
    keys = ("loss", "grad_norm", "max_logits", "expert_load")
    assert [[m[k] for k in keys] for m in read_metrics(tmp_path / "on" / "metrics.jsonl")] == \
        [[m[k] for k in keys] for m in read_metrics(tmp_path / "off" / "metrics.jsonl")]
    for (name, a), b in zip(on.raw_model.state_dict().items(), off.raw_model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="activation_checkpointing: Linear does not support it"):
        Trainer(torch.nn.Linear(2, 2), CountingData(), cfg(activation_checkpointing=True), tmp_path / "linear")


def test_report_to_tensorboard_gets_every_step_metric(tmp_path, monkeypatch):
    """`report_to="tensorboard"`: every metric of every step, nested ones as `key/subkey`, at its step (TensorBoard
    stores float32), the run's settings as hyperparameters; an unknown or uninstalled tracker, or one that fails to
    start, is a ConfigError."""
    import accelerate.tracking
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(tiny_lm(), CountingData(), cfg(steps=4, report_to="tensorboard"), tmp_path,
            val_data=CountingData(seed=1)).train()
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    (events,) = (tmp_path / "trackers" / "kimi-vl").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events))
    board.Reload()
    for key in ("loss", "lr", "grad_norm", "max_logits/model.layers.3.self_attn", "expert_load/model.layers.1.mlp.gate"):
        name, _, sub = key.partition("/")
        logged = [(e.step, e.value) for e in board.Scalars(key)]
        assert logged == [(m["step"], pytest.approx(m[name][sub] if sub else m[name], rel=1e-6)) for m in metrics]
    assert [(e.step, e.value) for e in board.Scalars("val_loss")] == [(4, pytest.approx(metrics[-1]["val_loss"]))]
    assert "step" not in board.Tags()["scalars"]
    assert "lr: 0.01" in next((tmp_path / "trackers" / "kimi-vl").glob("*/hparams.yml")).read_text()
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) \['tensorbored'\]; choose from tensorboard, wandb"):
        cfg(report_to="tensorboard,tensorbored")

    def refuse(*args, **kwargs):
        raise RuntimeError("no server")

    monkeypatch.setattr(accelerate.tracking.TensorBoardTracker, "start", refuse)
    with pytest.raises(ConfigError, match=r"starting tensorboard failed \(RuntimeError: no server\)"):
        Trainer(tiny_lm(), CountingData(), cfg(report_to="tensorboard"), tmp_path / "y").train()
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    with pytest.raises(ConfigError, match=r"report_to: comet_ml is not installed; `pip install comet-ml`"):
        cfg(report_to="comet_ml")


def test_an_iterable_of_batches_is_refused_before_training(tmp_path):
    """A list of batches or a DataLoader (a nanoGPT / torchtitan loop's data) cannot be resumed at a step: the
    trainer says so, and what to give instead, when it is built, not with an AttributeError in the first step."""
    batches = [CountingData().batch(i) for i in range(8)]
    for data in (batches, torch.utils.data.DataLoader(batches, batch_size=None)):
        with pytest.raises(ConfigError, match=rf"data is a {type(data).__name__}, not a BatchSource: .*batch\(index\)"):
            Trainer(tiny_lm(), data, cfg(), tmp_path)
    with pytest.raises(ConfigError, match=r"val_data is a list, not a BatchSource"):
        Trainer(tiny_lm(), CountingData(), cfg(), tmp_path, val_data=batches)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_report_to_takes_a_list_of_trackers_as_transformers_does():
    """`report_to=["tensorboard"]` (transformers' `TrainingArguments` form), in a `TrainConfig` or a stage's
    settings, is the comma-separated setting: the same run configuration, an empty list no tracker."""
    assert cfg(report_to=["tensorboard"]).report_to == "tensorboard" and cfg(report_to=[]).report_to == ""
    for value in (["tensorboard"], ("tensorboard",)):
        assert resolve("pretrain", "tiny", {"report_to": value}) == resolve("pretrain", "tiny",
                                                                            {"report_to": "tensorboard"})
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) \['tensorbored'\]"):
        resolve("sft", "tiny", {"report_to": ["tensorboard", "tensorbored"]})


def test_ranks_that_see_different_checkpoints_stop(tmp_path, monkeypatch):
    """A rank whose --out shows another checkpoint than rank 0's (a folder on each machine's own disk) stops the run
    with CheckpointError on every rank, rather than each rank training on from its own step."""
    import kimi_vl.training.trainer as trainer_module

    Trainer(tiny_lm(), CountingData(), cfg(steps=4), tmp_path).train()  # a checkpoint at step 4
    seen = []
    monkeypatch.setattr(trainer_module, "gather_ints", lambda step, device: seen.append(step) or [step, 0])
    with pytest.raises(CheckpointError, match=r"different checkpoints in .*state \(rank 0: step 4, rank 1: none\): "
                                              r"every rank must read the same --out folder"):
        Trainer(tiny_lm(), CountingData(), cfg(steps=8), tmp_path).train()
    assert seen == [4]
    monkeypatch.setattr(trainer_module, "gather_ints", lambda step, device: [step, step])
    Trainer(tiny_lm(), CountingData(), cfg(steps=8), tmp_path).train()  # agreeing ranks resume
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 9))


def test_interrupted_checkpoint_write_never_loads(tmp_path, monkeypatch):
    model = tiny_lm()
    trainer = Trainer(model, CountingData(), cfg(steps=2, checkpoint_every=100), tmp_path)
    trainer.train()
    good = ckpt.latest_checkpoint(tmp_path / "state")
    assert good is not None and good.name == "step_00000002"

    real_save = ckpt.save_file

    def dying_save(tensors, filename, *a, **k):
        if str(filename).endswith("rng.safetensors"):
            raise OSError("disk full")
        return real_save(tensors, filename, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", dying_save)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path / "state", 3, model=model, optimizer=trainer.optimizer, trainer_state={})
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path / "state") == good  # the half-written step 3 is invisible
    assert any(".tmp" in p.name for p in (tmp_path / "state").iterdir())
    with pytest.raises(CheckpointError, match="not a complete"):
        partial = next(p for p in (tmp_path / "state").iterdir() if ".tmp" in p.name)
        ckpt.load_checkpoint(partial, model=model, optimizer=trainer.optimizer)
    state = ckpt.load_checkpoint(good, model=model, optimizer=trainer.optimizer)
    assert state["step"] == 2 and json.loads((good / "trainer_state.json").read_text())["tokens"] == 2 * 64


def test_nonfinite_steps_are_skipped_then_stop(tmp_path):
    model = tiny_lm()
    poisoned = {2, 3, 5, 6, 7}  # 0-based optimizer steps whose loss is NaN

    class Poison:
        step = 0

    def hook(module, args, output):
        return output * float("nan") if Poison.step in poisoned else output

    model.model.embed_tokens.register_forward_hook(hook)
    data = CountingData()
    trainer = Trainer(model, data, cfg(steps=10, nan_patience=3, checkpoint_every=100), tmp_path)
    real_batch = data.batch

    def batch(index):
        Poison.step = index
        return real_batch(index)

    data.batch = batch
    before = {}

    real_step = trainer.optimizer.step

    def step(*a, **k):
        before[trainer.step] = True
        return real_step(*a, **k)

    trainer.optimizer.step = step
    with pytest.raises(TrainingDivergedError, match="3 steps in a row.*start over: no checkpoint was written yet"):
        trainer.train()
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["skipped"] for m in metrics] == [False, False, True, True, False, True, True, True]
    assert all((m["max_logits"] == {}) == m["skipped"] for m in metrics)  # a skipped step reports no maxima
    assert sorted(before) == [0, 1, 4]  # the optimizer never ran on a poisoned step
    assert metrics[-1]["skipped_total"] == 5
    assert {m.get("skip_reason") for m in metrics if m["skipped"]} == {"non-finite"}
    assert all(torch.isfinite(p).all() for p in model.parameters())


class SignalAt(CountingData):
    """`CountingData` that sends this process `signals[i]` while building batch `i` (in the middle of a step)."""

    def __init__(self, signals: dict[int, list[int]]) -> None:
        super().__init__()
        self.signals = signals

    def batch(self, index: int) -> Batch:
        for sig in self.signals.get(index, []):
            os.kill(os.getpid(), sig)
        return super().batch(index)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_ends_the_run_after_its_step_with_a_checkpoint(tmp_path, capsys, sig):
    """Ctrl-C or a scheduler's SIGTERM in step 3 (no periodic checkpoint before step 100): the step finishes, a
    checkpoint of it is written, `TrainingInterrupted` says so, the signal handlers are restored, and the rerun
    reproduces the uninterrupted curve."""
    before = signal.getsignal(sig)
    Trainer(tiny_lm(), CountingData(), cfg(checkpoint_every=100), tmp_path / "full").train()
    cut = tmp_path / "cut"
    with pytest.raises(TrainingInterrupted, match=rf"{sig.name}: stopped after step 3 of 8 with a checkpoint in ") as e:
        Trainer(tiny_lm(), SignalAt({2: [sig]}), cfg(checkpoint_every=100), cut).train()
    assert e.value.exit_status == 128 + sig  # as a process the signal ended: 130, 143
    announced = capsys.readouterr().err
    assert f"{sig.name}: stopping after this step with a checkpoint" in announced
    assert ("press Ctrl-C again" in announced) == (sig == signal.SIGINT)
    assert signal.getsignal(sig) is before
    assert [p.name for p in ckpt.list_checkpoints(cut / "state")] == ["step_00000003"]
    assert [m["step"] for m in read_metrics(cut / "metrics.jsonl")] == [1, 2, 3]
    Trainer(tiny_lm(seed=7), CountingData(), cfg(checkpoint_every=100), cut).train()
    got, want = read_metrics(cut / "metrics.jsonl"), read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in got] == [(m["step"], m["loss"], m["grad_norm"])
                                                                     for m in want]


def test_a_stop_signal_in_the_last_step_stops_too(tmp_path):
    """SIGTERM in the last step: the run stops there with its checkpoint rather than returning as finished, so that a
    caller running several runs (the Vision-RL ablation, the quickstart's stages) does not go on to the next after
    announcing the stop; the rerun resumes at the end."""
    cut = tmp_path / "cut"
    with pytest.raises(TrainingInterrupted, match="SIGTERM: stopped after step 8 of 8 with a checkpoint"):
        Trainer(tiny_lm(), SignalAt({7: [signal.SIGTERM]}), cfg(checkpoint_every=100), cut).train()
    assert [p.name for p in ckpt.list_checkpoints(cut / "state")] == ["step_00000008"]
    assert Trainer(tiny_lm(), CountingData(), cfg(checkpoint_every=100), cut).train()["step"] == 8


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny_lm(), SignalAt({2: [signal.SIGINT, signal.SIGINT]}), cfg(checkpoint_every=100), tmp_path).train()
    assert ckpt.list_checkpoints(tmp_path / "state") == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_callers_own_signal_handler_stays_in_charge(tmp_path):
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        Trainer(tiny_lm(), SignalAt({2: [signal.SIGTERM]}), cfg(checkpoint_every=100), tmp_path).train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM] and read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] == 8


def test_a_time_limit_ends_the_run_with_a_checkpoint(tmp_path):
    """`max_minutes` passed (here at once): the run stops after its first step with a checkpoint, exit status 124 as
    `timeout`'s; the rerun, without the limit, goes on to the uninterrupted curve."""
    with pytest.raises(ConfigError, match=r"max_minutes must be > 0 \(or none/null for no time limit\), got 0\."):
        cfg(max_minutes=0)
    Trainer(tiny_lm(), CountingData(), cfg(checkpoint_every=100), tmp_path / "full").train()
    cut = tmp_path / "cut"
    with pytest.raises(TrainingInterrupted, match="time limit of 1e-06 min: stopped after step 1 of 8") as e:
        Trainer(tiny_lm(), CountingData(), cfg(checkpoint_every=100, max_minutes=1e-6), cut).train()
    assert e.value.exit_status == 124
    assert [p.name for p in ckpt.list_checkpoints(cut / "state")] == ["step_00000001"]
    Trainer(tiny_lm(seed=7), CountingData(), cfg(checkpoint_every=100), cut).train()
    got, want = read_metrics(cut / "metrics.jsonl"), read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [(m["step"], m["loss"]) for m in got] == [(m["step"], m["loss"]) for m in want]



class TwoStepBatches(LanguageModelStep):
    """Checkpoints only after every second step, as RL with two updates per rollout batch."""

    def can_checkpoint(self, step: int) -> bool:
        return step % 2 == 0


def test_a_checkpoint_due_inside_a_rollout_batch_is_written_at_its_end(tmp_path):
    """checkpoint_every 3 with checkpoints possible after even steps only: the one due after step 3 is written after
    step 4 (the batch's end), not dropped until step 6 (a common multiple)."""
    Trainer(tiny_lm(), TwoStepBatches(CountingData()), cfg(steps=8, checkpoint_every=3, keep_checkpoints=5),
            tmp_path).train()
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "state")] == [4, 6, 8]

def test_fsdp_asked_of_accelerate_on_cpus_is_not_silently_ddp(tmp_path, monkeypatch):
    """`accelerate launch --use_fsdp` sets ACCELERATE_USE_FSDP, which accelerate ignores on CPUs (it trains with DDP,
    or one process): the trainer says so rather than let the run pass for a sharded one."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.warns(UserWarning, match="FSDP on GPUs only; on CPUs every process holds the whole model"):
        Trainer(tiny_lm(), CountingData(), cfg(steps=1), tmp_path)


class TargetlessData(CountingData):
    """Odd micro-batches without a single target (every label -100, as a row of image tokens or of prompts)."""

    def batch(self, index: int) -> Batch:
        b = super().batch(index)
        if index % 2:
            b.labels = torch.full_like(b.labels, -100)
        return b


@pytest.mark.parametrize("normalisation", ["token", "document"])
def test_a_micro_batch_without_targets_adds_nothing_to_its_step(tmp_path, normalisation):
    """A micro-batch (of a process, or of gradient accumulation) with no target has no mean loss (0 / 0): the step
    is the other micro-batches' mean, as one batch of them all, not a NaN step skipped with its targets thrown away."""
    settings = dict(steps=2, loss_normalisation=normalisation, max_grad_norm=None)
    Trainer(tiny_lm(), TargetlessData(), cfg(grad_accum=2, **settings), tmp_path / "accumulated").train()
    Trainer(tiny_lm(), MergedData(TargetlessData()), cfg(**settings), tmp_path / "one").train()
    accumulated, one = read_metrics(tmp_path / "accumulated" / "metrics.jsonl"), read_metrics(tmp_path / "one" /
                                                                                               "metrics.jsonl")
    assert not any(m["skipped"] for m in accumulated + one)
    for a, b in zip(accumulated, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_validation_leaves_out_batches_without_targets(tmp_path):
    """A validation batch without targets has no loss (0 / 0): the validation loss is the other batches' mean, not
    NaN (here batch 1 of 2 has none: the loss is batch 0's)."""
    trainer = Trainer(tiny_lm(), CountingData(), cfg(steps=1, val_batches=2), tmp_path, val_data=TargetlessData(seed=1))
    only_first = Trainer(tiny_lm(), CountingData(), cfg(steps=1, val_batches=1), tmp_path / "first",
                         val_data=TargetlessData(seed=1))
    assert trainer.evaluate() == pytest.approx(only_first.evaluate(), rel=1e-6)
    assert math.isfinite(trainer.evaluate())


class EmptyStepData(CountingData):
    """`CountingData` whose batches `empty` have no target at all (every label -100: a batch of video blocks)."""

    def __init__(self, empty: set[int]) -> None:
        super().__init__()
        self.empty = empty

    def batch(self, index: int) -> Batch:
        b = super().batch(index)
        if index in self.empty:
            b.labels = torch.full_like(b.labels, -100)
        return b


def test_a_step_whose_global_batch_has_no_target_is_skipped_not_stepped(tmp_path):
    """A step without a single target (every micro-batch; here both of grad_accum 2) has no gradient signal: it is
    skipped (momentum and weight decay would move the weights), logged with a loss of none and its own reason, and
    does not count toward nan_patience (0 here: the first non-finite step would stop the run)."""
    data = EmptyStepData(empty={2, 3, 6, 7})  # steps 1 and 3 (0-based), both micro-batches
    trainer = Trainer(tiny_lm(), data, cfg(steps=4, grad_accum=2, nan_patience=0), tmp_path)
    stepped = {}
    real_step = trainer.optimizer.step

    def step(*a, **k):
        out = real_step(*a, **k)
        stepped[trainer.step] = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
        return out

    trainer.optimizer.step = step
    trainer.train()
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert sorted(stepped) == [0, 2]
    assert [m["skipped"] for m in metrics] == [False, True, False, True]
    assert [m.get("skip_reason") for m in metrics] == [None, "no targets", None, "no targets"]
    assert metrics[1]["loss"] is None and metrics[-1]["skipped_total"] == 2
    assert metrics[1]["max_logits"] == {} and metrics[1]["expert_load"] == {}
    assert metrics[1]["tokens"] == 2 * 2 * 64  # its tokens count all the same
    for n, p in trainer.raw_model.named_parameters():  # the skipped last step left the weights as step 2 did
        assert torch.equal(p, stepped[2][n]), n
