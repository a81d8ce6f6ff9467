"""The one training loop, readable top to bottom in `Trainer.train`, for language-model steps and RL steps alike.

What one optimizer step computes is a `TrainingStep`: its `backward(trainer)` leaves the gradients of its objective
in `.grad` and returns the step's loss, token count and metrics.
- `LanguageModelStep` (pre-training, SFT): `grad_accum` micro-batches per process. Micro-batch `m` of step `s` on
  rank `r` of `W` is `data.batch((s * grad_accum + m) * W + r)`: batches are pure functions of their index, so a
  resumed run sees exactly the batches the uninterrupted one would have, and the loss curve is reproduced bit for
  bit on CPU; resumed with another `grad_accum` or number of processes, it goes on after the batches drawn so far
  (recorded in the checkpoint). `num_workers` data-loader processes build them ahead.
- `kimi_vl.training.rl.RLStep` (RL): rollouts, rewards and one update of the K2.5 objective (or GRPO).

Per step: the step's forward/backward under accelerate (bf16 autocast on GPU, fp32 on CPU; DDP or FSDP2 across
processes), a non-finite guard (a step whose loss or gradient norm is NaN/Inf is skipped and counted; `nan_patience`
in a row stop training with `TrainingDivergedError`; a step whose global batch has no loss target is skipped and
counted too, with its own `skip_reason`, but not toward `nan_patience`), gradient clipping, the WSD learning rate,
the optimizer step (MuonClip: update then QK-Clip) and its post-step hooks (the aux-loss-free router-bias update,
`kimi_vl.training.router_balancing`), one JSONL metrics line, and periodic atomic checkpoints
(`kimi_vl.training.checkpoint`) where the step allows them. SIGINT (Ctrl-C) or SIGTERM (a scheduler), or
`max_minutes` passed, ends the run at the next step that allows a checkpoint, with one, by `TrainingInterrupted`
(`kimi_vl.training.stop`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..data.loader import batches
from ..data.mixture import fingerprint_changes
from ..errors import CheckpointError, ConfigError, DataError, TrainingDivergedError, TrainingInterrupted
from ..progress import progress_bar
from ..text.modeling import loss_denominator
from .checkpoint import checkpoint_step, latest_checkpoint, load_checkpoint, save_checkpoint
from .distributed import gather_ints
from .muonclip import MuonClip
from .router_balancing import RouterBalancing
from .stop import StopOnSignal, any_rank
from .trackers import check_installed, hyperparameters, parse_report_to, scalars

DATA_ERRORS = "data_errors.jsonl"
SKIP_NONFINITE, SKIP_NO_TARGETS = "non-finite", "no targets"
"""The `skip_reason` of a skipped step's metrics record: a NaN/Inf loss or gradient norm, or a global batch without
any loss target."""


class BatchSource(Protocol):
    """Anything with a deterministic `batch(index)` returning an object with `model_inputs()` and token counts."""

    def batch(self, index: int) -> Any: ...


def _packed_only(default: Any) -> Any:
    """A `TrainConfig` field of the packed-data stages (pretrain, sft) only; the others apply to RL as well."""
    return field(default=default, metadata={"stages": ("pretrain", "sft")})


_COUNT_MINIMA = {"steps": 1, "grad_accum": 1, "warmup_steps": 0, "nan_patience": 0, "checkpoint_every": 1,
                 "keep_checkpoints": 1, "val_every": 0, "val_batches": 1}
"""The least value of each count (integer setting) of `TrainConfig`."""

_FLOAT_RANGES: dict[str, tuple[float, bool, float | None, str | None]] = {
    "lr": (0, False, None, None),
    "weight_decay": (0, True, None, None),
    "qk_clip_tau": (0, False, None, "to disable QK-Clip"),
    "decay_fraction": (0, True, 1, None),
    "min_lr_ratio": (0, True, 1, None),
    "max_grad_norm": (0, False, None, "to disable clipping"),
    "router_bias_rate": (0, True, None, None),
    "max_minutes": (0, False, None, "for no time limit"),
    "vision_lr_scale": (0, True, None, None),
}
"""The range of each real-valued setting of `TrainConfig`: `(lowest, whether lowest itself is allowed, highest
(included) or None, what None means where it is allowed)`; every value must also be finite."""


def _check_float(name: str, value: Any, low: float, low_allowed: bool, high: float | None,
                 none_means: str | None) -> None:
    """`ConfigError` naming `name`, `value` and the allowed range unless `value` lies in it (see `_FLOAT_RANGES`)."""
    if value is None and none_means is not None:
        return
    allowed = (f"in [{low:g}, {high:g}]" if high is not None else f"{'>=' if low_allowed else '>'} {low:g}") + (
        f" (or none/null {none_means})" if none_means is not None else "")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number {allowed}, got {value!r}.")
    shown = f"{value:g}" if float(value).is_integer() else repr(float(value))
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite and {allowed}, got {shown}.")
    if value < low or (value == low and not low_allowed) or (high is not None and value > high):
        raise ConfigError(f"{name} must be {allowed}, got {shown}.")


def _check_count(name: str, value: Any, lowest: int) -> None:
    """`ConfigError` naming `name`, `value` and the least allowed unless `value` is an integer >= `lowest`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lowest:
        raise ConfigError(f"{name} must be an integer >= {lowest}, got {value!r}.")


@dataclass
class TrainConfig:
    """Settings of one training run (each is also a `kimi-vl train` option: `--lr`, `--grad-accum`, ...).

    The learning rate follows warmup-stable-decay (WSD): linear warmup over `warmup_steps`, constant, then a linear
    decay to `min_lr_ratio * lr` over the last `decay_fraction` of the steps.

    Attributes:
        steps: optimizer steps.
        lr: peak learning rate.
        optimizer: muonclip or adamw (torch's AdamW: no QK-Clip, so qk_clip_tau does not apply and no max logits
            are recorded).
        weight_decay: decoupled weight decay of the parameters that get a gradient in the step (muonclip: every
            one, both its groups; adamw: those of two or more dimensions, embeddings and head included; a vision
            tower that zero-vision SFT never runs keeps its weights).
        qk_clip_tau: QK-Clip threshold on the max attention logit (none: off).
        grad_accum: micro-batches per optimizer step and process (RL: `micro_batch_size` splits the rollouts).
        warmup_steps: linear warmup steps.
        decay_fraction: fraction of the steps spent in the final linear decay.
        min_lr_ratio: learning rate at the end of the decay, as a fraction of lr.
        max_grad_norm: gradient-norm clipping (none: off).
        router_bias_rate: step of the aux-loss-free router-bias update.
        nan_patience: non-finite steps in a row before training stops.
        checkpoint_every: steps between training-state checkpoints (RL: at the end of the rollout batch that
            holds the step).
        keep_checkpoints: newest checkpoints kept.
        val_every: steps between validation losses (0: only at the end, when there is validation data).
        val_batches: batches per validation loss.
        loss_normalisation: token (the mean over every target token of a batch) or document (each packed document
            weighs the same: the mean of the documents' token means, so short answers count as much as long texts;
            validation losses stay token means).
        precision: auto (bf16 autocast on CUDA, fp32 on CPU), no (fp32) or bf16.
        progress: show progress (a bar on a terminal or in a notebook, a line every 30 s in a log).
        max_minutes: stop with a checkpoint once this many minutes of training have passed in this process (a
            cluster job's time limit; none: no limit); rerunning the command resumes there and counts afresh.
        activation_checkpointing: keep only each layer's input in the forward pass and recompute the layer in the
            backward pass (every token mixer and feed-forward of the language model, Block AttnRes's depth mixing,
            every vision block): less memory for about one more forward's time; the same numbers.
        report_to: experiment trackers that also get every step's metrics, comma-separated (in Python also a list):
            tensorboard, wandb, mlflow, trackio, ... (accelerate's; each needs its package; local ones write under
            OUT/trackers; none: only metrics.jsonl and the plots).
        vision_tower: a MoonViT checkpoint folder whose weights the vision tower starts from (the ViT stage's
            output, `kimi-vl train vit`, or a tower of the preset's shape converted by `kimi-vl convert
            kimi-k25-vision`); none: the tower starts from scratch.
        vision_lr_scale: the vision tower's learning rate as a fraction of lr (its weight decay scales with it):
            below 1 the tower moves slower than the language model, keeping longer what it learned before (a
            `vision_tower`); 0 holds it fixed.
    """

    steps: int = 1000
    lr: float = 3e-3
    optimizer: str = "muonclip"
    weight_decay: float = 0.1
    qk_clip_tau: float | None = 100.0
    grad_accum: int = _packed_only(1)
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    router_bias_rate: float = 1e-3
    nan_patience: int = 5
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    val_every: int = _packed_only(0)
    val_batches: int = _packed_only(4)
    loss_normalisation: str = field(default="token", metadata={"stages": ("pretrain", "sft"),
                                                               "choices": ("token", "document")})
    precision: str = "auto"
    progress: bool = True
    max_minutes: float | None = None
    activation_checkpointing: bool = False
    report_to: str | None = field(default=None, metadata={"join": ","})
    vision_tower: str | None = field(default=None, metadata={"stages": ("pretrain",)})
    vision_lr_scale: float = field(default=1.0, metadata={"stages": ("pretrain", "sft", "rl")})

    def __post_init__(self) -> None:
        if isinstance(self.report_to, (list, tuple)):  # ["tensorboard", "wandb"], as transformers' TrainingArguments
            self.report_to = ",".join(map(str, self.report_to))
        check_installed(parse_report_to(self.report_to))  # before a stage builds its data
        for name, lowest in _COUNT_MINIMA.items():
            _check_count(name, getattr(self, name), lowest)
        for name, (low, low_allowed, high, none_means) in _FLOAT_RANGES.items():
            _check_float(name, getattr(self, name), low, low_allowed, high, none_means)
        if self.optimizer not in ("muonclip", "adamw"):
            raise ConfigError(f"optimizer must be 'muonclip' or 'adamw', got {self.optimizer!r}.")
        if self.loss_normalisation not in ("token", "document"):
            raise ConfigError(f"loss_normalisation must be 'token' or 'document', got {self.loss_normalisation!r}.")
        if self.precision not in ("auto", "no", "bf16"):
            raise ConfigError(f"precision must be 'auto', 'no' or 'bf16', got {self.precision!r}.")


def wsd_lr(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based) under warmup-stable-decay. Where the warmup reaches into
    the decay (a run of fewer steps than `warmup_steps` plus its decay) the lower of the two lines holds: the rate
    does not leap from the warmup's peak into the decay, and the last step still ends at `min_lr_ratio * lr`."""
    warmup = cfg.lr * (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else cfg.lr
    decay_steps = round(cfg.steps * cfg.decay_fraction)
    decay_start = cfg.steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return warmup
    progress = (step - decay_start + 1) / decay_steps
    return min(warmup, cfg.lr * (1 - (1 - cfg.min_lr_ratio) * progress))


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """MuonClip or AdamW over `model`'s trainable parameters; with `cfg.vision_lr_scale != 1` the vision tower's
    parameters form groups of their own whose `lr_scale` the trainer multiplies the step's rate by
    (`scale_vision_groups`)."""
    if cfg.optimizer == "muonclip":
        optimizer = MuonClip(model, cfg.lr, weight_decay=cfg.weight_decay, qk_clip_tau=cfg.qk_clip_tau)
    else:
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                                      betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.vision_lr_scale != 1.0:
        scale_vision_groups(optimizer, model, cfg.vision_lr_scale)
    return optimizer


def scale_vision_groups(optimizer: torch.optim.Optimizer, model: nn.Module, scale: float) -> None:
    """Move the parameters of `model.vision_tower` out of each of `optimizer`'s groups into a copy of that group
    (same rule and settings) with `lr_scale = scale`; `ConfigError` for a model without a vision tower. Call it
    before the first step (no optimizer state yet)."""
    tower = getattr(model, "vision_tower", None)
    if tower is None:
        raise ConfigError(f"vision_lr_scale={scale} scales a vision tower's rate, and {type(model).__name__} has no "
                          "vision_tower; leave vision_lr_scale at 1.")
    ids = {id(p) for p in tower.parameters()}
    groups = []
    for group in optimizer.param_groups:
        rest = [p for p in group["params"] if id(p) not in ids]
        vision = [p for p in group["params"] if id(p) in ids]
        split = ({**group, "params": rest}, {**group, "params": vision, "lr_scale": scale})
        groups += [g for g in split if g["params"]]
    optimizer.param_groups = groups


def unigram_entropy(data: BatchSource, num_batches: int = 8) -> float:
    """Cross-entropy (nats/token) of the best context-free predictor of the labels in the first batches: the
    baseline a trained model's loss must fall well below."""
    counts: dict[int, int] = {}
    for i in range(num_batches):
        labels = data.batch(i).labels
        for tok, n in zip(*torch.unique(labels[labels != -100], return_counts=True)):
            counts[int(tok)] = counts.get(int(tok), 0) + int(n)
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values())


def _check_batch_source(name: str, data: Any) -> None:
    """`ConfigError` unless `data` is a `BatchSource` (an iterable or a DataLoader is not: it cannot be resumed at a
    step)."""
    if not callable(getattr(data, "batch", None)):
        raise ConfigError(f"{name} is a {type(data).__name__}, not a BatchSource: the trainer draws batch i as "
                          f"{name}.batch(i), a pure function of i (which is what resuming at a step needs), so an "
                          "iterable or a DataLoader cannot stand in; give an object whose batch(index) returns batch "
                          "`index` (for a list of batches: batches[index]), or a TrainingStep as data.")


class TrainingStep(Protocol):
    """What one optimizer step computes (see the module docstring)."""

    def start(self, trainer: Trainer) -> None:
        """Called once before the first step of a run (after a resume: `trainer.step` is where it goes on)."""

    def backward(self, trainer: Trainer) -> dict[str, Any]:
        """Leave the gradients of optimizer step `trainer.step` in `.grad`; return `loss` (the global batch's; None
        when the global batch has no loss target: the step is skipped), `tokens` (the global batch's), `bad_records`
        (records skipped, a list of dicts) and any metrics to log."""

    def can_checkpoint(self, step: int) -> bool:
        """Whether the state after `step` optimizer steps may be checkpointed (a resume restarts from it)."""

    def finish(self) -> None:
        """Called once when the run ends, however it ends: release what `start` took (data-loader workers)."""


class LanguageModelStep:
    """Next-token loss on packed batches: `grad_accum` micro-batches per process (see the module docstring)."""

    def __init__(self, data: BatchSource, num_workers: int = 0) -> None:
        self.data, self.num_workers = data, num_workers
        self.stream: Iterator[Any] | None = None

    def start(self, trainer: Trainer) -> None:
        cfg, acc = trainer.cfg, trainer.accelerator
        world, rank = acc.num_processes, acc.process_index
        # after the batches drawn before (a resumed run with another grad_accum or world size neither repeats nor
        # skips any); with the same ones, step s draws (s * grad_accum + m) * world + rank as an unbroken run does
        indices = [trainer.batches_drawn + (k * cfg.grad_accum + m) * world + rank
                   for k in range(cfg.steps - trainer.step) for m in range(cfg.grad_accum)]
        self.stream = batches(self.data, indices, self.num_workers)

    def can_checkpoint(self, step: int) -> bool:
        return True

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.close()  # shuts the loader's workers down now, not at interpreter exit
            self.stream = None

    def backward(self, trainer: Trainer) -> dict[str, Any]:
        """Forward and backward of the step's micro-batches; the global batch's mean loss (over all its targets, or
        documents: `loss_denominator`; None when no micro-batch of any rank has a target), token counts, and what the
        data layer drew (documents per source, bad records skipped)."""
        acc, grad_accum, normalisation = trainer.accelerator, trainer.cfg.grad_accum, trainer.cfg.loss_normalisation
        world = acc.num_processes
        micro_batches = [next(self.stream) for _ in range(grad_accum)]
        trainer.batches_drawn += grad_accum * world
        # each micro-batch's mean loss weighs by its share of the global batch's targets (or documents), so the step's
        # loss is the mean over the whole global batch, whatever its split into micro-batches and ranks
        counts = [loss_denominator(b.labels, b.cu_seqlens, per_document=normalisation == "document")
                  for b in micro_batches]
        step_count = sum(counts)
        if world > 1:
            global_count = torch.tensor([step_count], dtype=torch.float64, device=acc.device)
            torch.distributed.all_reduce(global_count)
            step_count = int(global_count.item())
        shares = [c / step_count if step_count else math.nan for c in counts]  # no targets at all: a NaN, skipped
        total, tokens, vision_tokens = 0.0, 0, 0
        drawn: dict[str, Any] = {"documents": Counter(), "bad_records": []}
        for micro, (batch, share) in enumerate(zip(micro_batches, shares)):
            drawn["documents"].update(getattr(batch, "documents", {}))
            drawn["bad_records"] += getattr(batch, "bad_records", [])
            batch = batch.to(acc.device)
            sync = nullcontext() if micro == grad_accum - 1 else acc.no_sync(trainer.model)
            with sync, acc.autocast():
                loss = trainer.model(**batch.model_inputs(), loss_normalisation=normalisation,
                                     return_logits=False).loss
            acc.backward(loss * (share * world))  # DDP averages the ranks' gradients: * world undoes it
            if counts[micro]:  # a micro-batch without targets has no mean loss (0 / 0: NaN) and adds nothing
                total += loss.detach().float().item() * share
            tokens += batch.num_tokens
            vision_tokens += batch.num_vision_tokens
        if world > 1:  # the global batch: mean loss, summed token counts, every rank's draws
            stats = torch.tensor([total, tokens, vision_tokens], dtype=torch.float64, device=acc.device)
            torch.distributed.all_reduce(stats)
            total, tokens, vision_tokens = stats[0].item(), int(stats[1]), int(stats[2])
            gathered: list[Any] = [None] * world
            torch.distributed.all_gather_object(gathered, drawn)
            drawn = {"documents": sum((Counter(g["documents"]) for g in gathered), Counter()),
                     "bad_records": [r for g in gathered for r in g["bad_records"]]}
        out = {"loss": total if step_count else None, "tokens": tokens, "vision_tokens": vision_tokens,
               "bad_records": drawn["bad_records"]}
        if drawn["documents"]:
            out["documents"] = dict(drawn["documents"])
        return out


class Trainer:
    """Trains `model` (see the module docstring); `out_dir` receives `metrics.jsonl`, `data_errors.jsonl` (one line
    per bad record skipped) and `state/`.

    `data` is a `TrainingStep`, or a `BatchSource` of packed batches (a `LanguageModelStep` with `num_workers`
    data-loader processes). `fingerprint` (a JSON-able description of the data) is stored in every checkpoint;
    resuming with a different one stops with `DataError` naming the differences unless `allow_data_change`.
    `hyperparameters` (flat settings; default: `cfg`'s) is what `report_to`'s trackers get as the run's settings."""

    def __init__(self, model: nn.Module, data: BatchSource | TrainingStep, cfg: TrainConfig, out_dir: str | Path, *,
                 val_data: BatchSource | None = None, desc: str = "train", fingerprint: dict[str, Any] | None = None,
                 allow_data_change: bool = False, num_workers: int = 0,
                 hyperparameters: dict[str, Any] | None = None) -> None:
        from accelerate import Accelerator, DistributedDataParallelKwargs
        from accelerate.state import AcceleratorState

        self.cfg, self.val_data, self.desc = cfg, val_data, desc
        if not hasattr(data, "backward"):
            _check_batch_source("data", data)
        if val_data is not None:
            _check_batch_source("val_data", val_data)
        self.training_step = data if hasattr(data, "backward") else LanguageModelStep(data, num_workers)
        self.fingerprint, self.allow_data_change = fingerprint, allow_data_change
        self.hyperparameters = hyperparameters if hyperparameters is not None else asdict(cfg)
        self.out_dir = Path(out_dir)
        precision = cfg.precision
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() else "no"
        # accelerate keeps one process-wide state and refuses a second Accelerator with another precision; a notebook
        # that trains in fp32 and then in bf16 gets a fresh state (the process group, in PartialState, stays)
        if AcceleratorState._shared_state and AcceleratorState().mixed_precision != precision:
            AcceleratorState._reset_state()
        # find_unused_parameters: a rank whose batch holds no image or video leaves the vision tower without gradients
        self.trackers = parse_report_to(cfg.report_to)
        self.accelerator = Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available(),
                                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
                                       log_with=self.trackers or None, project_dir=self.out_dir / "trackers")
        if cfg.activation_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ConfigError(f"activation_checkpointing: {type(model).__name__} does not support it (no "
                                  "`activation_checkpointing_enable`); train without it.")
            model.activation_checkpointing_enable()
        self.optimizer = build_optimizer(model, cfg)
        if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and self.accelerator.distributed_type != "FSDP":
            warnings.warn("accelerate launch --use_fsdp: accelerate shards with FSDP on GPUs only; on CPUs every "
                          "process holds the whole model and optimizer state (DDP across processes: the same updates).",
                          stacklevel=2)
        if self.accelerator.is_fsdp2:
            # every rank holds the whole model already (built from the seed or read from the checkpoint); accelerate's
            # loading from rank 0 alone (`accelerate launch --use_fsdp`'s default) fails on persistent buffers, the
            # routers' `e_score_correction_bias`
            self.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = False
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        self.raw_model = self.accelerator.unwrap_model(self.model)
        self.inner_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # unwrapped from accelerate
        self.balancing = RouterBalancing(self.raw_model, self.inner_optimizer, cfg.router_bias_rate)
        self.state_dir = self.out_dir / "state"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.errors_path = self.out_dir / DATA_ERRORS
        self.step = 0
        self.tokens = 0
        self.batches_drawn = 0  # batch indices of the data drawn so far, every rank's (language-model steps)
        self.skipped = 0
        self.nonfinite_in_a_row = 0

    # -- the loop -------------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run (or resume) until `cfg.steps`; returns the summary of the last step (its `metrics.jsonl` record)."""
        cfg = self.cfg
        self._resume()
        if self.step >= cfg.steps:  # resumed at its end (stopped after its last checkpoint): that step's record
            records = read_metrics(self.metrics_path) if self.metrics_path.is_file() else []
            return records[-1] if records else {}
        self.model.train()
        bar = progress_bar(total=cfg.steps, initial=self.step, desc=self.desc,
                           enabled=cfg.progress and self.accelerator.is_main_process, unit="step")
        self.training_step.start(self)
        try:
            return self._steps(bar)
        finally:  # however the run ends: an open bar would stay among tqdm's and push the next one down a line
            bar.close()
            self.training_step.finish()

    def _steps(self, bar: Any) -> dict[str, Any]:
        """The steps from `self.step` to `cfg.steps` (`train`'s loop), counted on `bar`."""
        cfg = self.cfg
        last: dict[str, Any] = {}
        started = time.monotonic()
        checkpointed = self.step  # the step of the newest checkpoint (resumed from, or none yet: 0)
        with StopOnSignal(announce=self.accelerator.is_main_process) as stop, self._tracking():
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                out = self.training_step.backward(self)
                loss, tokens, bad = out.pop("loss"), out.pop("tokens"), out.pop("bad_records", [])
                grad_norm = self._grad_norm()
                # a global batch without loss targets (e.g. users' documents all image or video blocks) has no
                # gradient signal: skipped as a non-finite step is (momentum and weight decay would still move the
                # weights), but not counted toward nan_patience (nor ending a run of non-finite steps: it shows no
                # recovery)
                empty = loss is None
                finite = not empty and math.isfinite(loss) and math.isfinite(grad_norm)
                lr = wsd_lr(self.step, cfg)
                if finite:
                    self.nonfinite_in_a_row = 0
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr * group.get("lr_scale", 1.0)
                    self.optimizer.step()  # post-step hooks: the router-bias update
                    loads = self.balancing.last_loads
                else:
                    self._discard_step(nonfinite=not empty)
                    loads = {}
                self.optimizer.zero_grad(set_to_none=True)
                self.tokens += tokens
                self.step += 1
                last = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens,
                        "skipped": not finite, "skipped_total": self.skipped, "max_logits": self._max_logits(),
                        "expert_load": loads, "step_time": time.perf_counter() - t0, **out}
                if not finite:
                    last["skip_reason"] = SKIP_NO_TARGETS if empty else SKIP_NONFINITE
                if bad:
                    last["bad_records"] = dict(Counter(r["source"] for r in bad))
                    self._log_errors([{"step": self.step, **r} for r in bad])
                if self.val_data is not None and (
                        self.step == cfg.steps or (cfg.val_every and self.step % cfg.val_every == 0)):
                    last["val_loss"] = self.evaluate()
                self._log(last)
                rewards = {"reward": f"{last['reward_mean']:.3f}"} if "reward_mean" in last else {}  # RL steps
                shown = "none" if empty else f"{loss:.3f}"
                bar.set_postfix(loss=shown, lr=f"{lr:.2e}", **rewards)  # before the count: a line shows it
                bar.update(1)
                if not finite and not empty and self.nonfinite_in_a_row >= cfg.nan_patience:
                    resume = (f"resume from the last checkpoint in {self.state_dir}"
                              if latest_checkpoint(self.state_dir) else "start over: no checkpoint was written yet")
                    raise TrainingDivergedError(
                        f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last at step "
                        f"{self.step}, lr {lr:.3g}); lower the learning rate, raise max_grad_norm's strictness, or "
                        f"{resume}.")
                can_checkpoint = self.training_step.can_checkpoint(self.step)
                time_up = cfg.max_minutes is not None and time.monotonic() - started >= 60 * cfg.max_minutes
                # a signal at the last step (checkpointed whatever the step allows) stops the run there too, so that
                # a caller running several stages or runs does not go on to the next; a time limit reached there does
                # not: the run is done
                at_end = self.step == cfg.steps
                stop_now = (any_rank(stop.received is not None or (time_up and not at_end), self.accelerator.device)
                            and (can_checkpoint or at_end))
                # due once a multiple of checkpoint_every has passed since the last one: where that step cannot be
                # checkpointed (RL: inside a rollout batch), at the next one that can
                due = self.step // cfg.checkpoint_every > checkpointed // cfg.checkpoint_every
                if (due and can_checkpoint) or at_end or stop_now:
                    self.save_state()
                    checkpointed = self.step
                if stop_now:
                    raise self._interrupted(stop, time_up)
        return last

    def _interrupted(self, stop: StopOnSignal, time_up: bool) -> TrainingInterrupted:
        if stop.received:
            reason, status = stop.received, 128 + stop.signum
        elif time_up:
            reason, status = f"time limit of {self.cfg.max_minutes:g} min", 124
        else:
            reason, status = "a stop signal or time limit on another rank", 130
        return TrainingInterrupted(
            f"{reason}: stopped after step {self.step} of {self.cfg.steps} with a checkpoint in {self.state_dir}; "
            "rerun the same command to resume there.", exit_status=status)

    def _grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.max_grad_norm is None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        else:
            norm = self.accelerator.clip_grad_norm_(params, self.cfg.max_grad_norm)
        return float(norm)

    def _discard_step(self, nonfinite: bool = True) -> None:
        """A skipped step leaves no trace: gradients, recorded max logits and expert loads are dropped. `nonfinite`:
        it counts toward `nan_patience` (a step skipped for having no loss target does not)."""
        self.skipped += 1
        self.nonfinite_in_a_row += nonfinite
        if isinstance(self.inner_optimizer, MuonClip):
            self.inner_optimizer.discard_step()
        self.balancing.reset()

    def _max_logits(self) -> dict[str, float]:
        maxima = getattr(self.inner_optimizer, "last_max_logits", {})
        return {name: float(s.max()) for name, s in maxima.items()}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `val_batches` batches of the validation data (the same batches every time); a batch without
        targets has no loss (0 / 0) and is left out (NaN if every one is)."""
        self.model.eval()
        losses = []
        for i in range(self.cfg.val_batches):
            batch = self.val_data.batch(i).to(self.accelerator.device)
            if not loss_denominator(batch.labels, batch.cu_seqlens):
                continue
            with self.accelerator.autocast():
                losses.append(float(self.model(**batch.model_inputs(), return_logits=False).loss))
        self.balancing.reset()
        if isinstance(self.inner_optimizer, MuonClip):  # validation forwards must not feed the next QK-Clip
            self.inner_optimizer.reset_max_logits()
        self.model.train()
        return sum(losses) / len(losses) if losses else math.nan

    @contextmanager
    def _tracking(self) -> Iterator[None]:
        """The `report_to` trackers' run, from the loop's start to its end however it ends (their files flushed)."""
        if not self.trackers:
            yield
            return
        try:
            self.accelerator.init_trackers("kimi-vl", config=hyperparameters(self.hyperparameters),
                                           init_kwargs={"wandb": {"name": f"{self.out_dir.name} ({self.desc})"}})
        except Exception as e:  # a tracker's own failure (no login, no server): say which, not its traceback
            raise ConfigError(f"report_to: starting {', '.join(self.trackers)} failed ({type(e).__name__}: {e}); fix "
                              "its setup (e.g. `wandb login`, a tracking server's URI) or drop it from --report-to.") \
                from e
        try:
            yield
        finally:  # not `end_training()`: it also destroys the process group, which the stage and command still use
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers = []

    # -- state ----------------------------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            append_jsonl(self.metrics_path, [record])
        if self.trackers:
            self.accelerator.log(scalars(record), step=record["step"])

    def _log_errors(self, records: list[dict[str, Any]]) -> None:
        if records and self.accelerator.is_main_process:
            append_jsonl(self.errors_path, records)

    def save_state(self) -> Path | None:
        """A checkpoint of the run in `state/`, written by rank 0 (every rank calls it: FSDP2 shards are gathered)."""
        self.accelerator.wait_for_everyone()
        state = {"tokens": self.tokens, "batches_drawn": self.batches_drawn, "skipped": self.skipped,
                 "nonfinite_in_a_row": self.nonfinite_in_a_row, "config": asdict(self.cfg), "data": self.fingerprint}
        return save_checkpoint(self.state_dir, self.step, model=self.raw_model, optimizer=self.optimizer,
                               trainer_state=state, keep=self.cfg.keep_checkpoints)

    def _resume(self) -> None:
        path = latest_checkpoint(self.state_dir)
        self._same_checkpoint_on_every_rank(path)
        if path is None:
            if self.accelerator.is_main_process:  # a fresh run: no stale curve from an earlier attempt
                rewind_metrics(self.metrics_path, 0)
                rewind_metrics(self.errors_path, 0)
            return
        saved = json.loads((path / "trainer_state.json").read_text())
        check_data(saved.get("data"), self.fingerprint, self.allow_data_change, path)
        optimizer = saved.get("config", {}).get("optimizer", self.cfg.optimizer)
        if optimizer != self.cfg.optimizer:  # its state does not fit this one's groups: say so, not torch's ValueError
            raise CheckpointError(f"{path} holds the state of a {optimizer} run, and this run trains with "
                                  f"{self.cfg.optimizer}; resume it with optimizer={optimizer!r} (--optimizer "
                                  f"{optimizer}), or write the new run to another folder.")
        state = load_checkpoint(path, model=self.raw_model, optimizer=self.optimizer)
        if state["step"] > self.cfg.steps:
            raise ConfigError(f"{self.state_dir} holds a checkpoint at step {state['step']}, past this run's "
                              f"{self.cfg.steps} steps; pass --steps {state['step']} or more to resume it, or write "
                              "the run to another --out.")
        self.step, self.tokens = state["step"], state["tokens"]
        # checkpoints written before it was recorded: as drawn by this run's grad_accum and world size
        self.batches_drawn = state.get("batches_drawn",
                                       self.step * self.cfg.grad_accum * self.accelerator.num_processes)
        self.skipped, self.nonfinite_in_a_row = state["skipped"], state["nonfinite_in_a_row"]
        if self.accelerator.is_main_process:
            rewind_metrics(self.metrics_path, self.step)
            rewind_metrics(self.errors_path, self.step)


    def _same_checkpoint_on_every_rank(self, path: Path | None) -> None:
        """`CheckpointError` on every rank unless all resume from the same step: ranks that see different `state/`
        folders (an --out on each machine's own disk) would otherwise train on, each from its own step, data and
        optimizer state."""
        steps = gather_ints(checkpoint_step(path) if path is not None else 0, self.accelerator.device)
        if len(set(steps)) > 1:
            found = ", ".join(f"rank {r}: {f'step {s}' if s else 'none'}" for r, s in enumerate(steps))
            raise CheckpointError(
                f"the ranks found different checkpoints in {self.state_dir} ({found}): every rank must read the same "
                "--out folder, written by rank 0; on several machines put it on a filesystem they all mount.")


def check_data(saved: dict[str, Any] | None, current: dict[str, Any] | None, allow_change: bool,
               checkpoint: Path) -> None:
    """Stop with `DataError` when the data of a resumed run differs from its checkpoint's (unless allowed)."""
    if saved is None or current is None or allow_change:
        return
    changes = fingerprint_changes(saved, current)
    if changes:
        raise DataError(f"the data differs from the data checkpoint {checkpoint} was trained on: "
                        + "; ".join(changes) + ". Resume with the same data, pass --allow-data-change to go on "
                        "with the new data, or use a new --out folder.")


def append_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def rewind_metrics(path: Path, step: int) -> None:
    """Drop the lines of a JSONL metrics file after `step` (a resumed run rewrites them; step 0 removes the file),
    and a last line that a crash cut short (written after the checkpoint of `step`). The file is replaced whole, so
    a kill while it is rewritten leaves the old one."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    lines = [line for line in path.read_text().splitlines() if line]
    try:
        json.loads(lines[-1] if lines else "{}")
    except json.JSONDecodeError:  # cut short by a crash mid-write: a step after the checkpoint
        lines.pop()
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    tmp = path.with_name(f"{path.name}.tmp")  # one name: a kill before the rename leaves none that piles up
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The JSONL metrics written by `Trainer` (one dict per step)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
