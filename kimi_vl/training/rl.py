"""RL: the K2.5 policy loss (and GRPO for comparison), group advantages, and the update; `RLStep` runs it in the
`Trainer` (the one training loop), `rl_step` / `rl_iteration` in loops of your own.

An RL step is

1. `rollout` (`kimi_vl.training.rollout`): for each of P prompts sample K responses with the hybrid cache and
   record the **old-policy** token log-probs right after sampling;
2. score every response with a verifiable reward (`kimi_vl.training.rewards.reward`, optional token budget) ->
   rewards `[P, K]`; `RLBatch` turns them into advantages per group and per-token loss weights;
3. `updates_per_batch` optimizer steps on the batch, each the gradients of one `rl_backward` (micro-batches).

Old log-probs come from the rollout-time policy and are computed with exactly the inputs (micro-batches, padding)
the update uses, so on the first update of a batch the ratio `pi_theta / pi_old` is 1 (exactly, on deterministic
kernels) and the K2.5 loss is the plain policy gradient with the group-mean baseline; the ratio, the clipping mask
and the squared log-ratio penalty only act when several updates are made per batch (`updates_per_batch > 1`), or
when the old log-probs come from a different engine than the trainer (K2.5's train/inference mismatch).

Shapes: N = P * K sequences, the K responses of prompt p in rows `p*K .. p*K + K-1`; T = longest response.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, ShapeError
from .rollout import Rollouts, rollout, token_logprobs

ALGORITHMS: tuple[str, ...] = ("k25", "grpo")

LOG_RATIO_LIMIT = 20.0
"""GRPO computes its ratio from the log-ratio clamped to +-LOG_RATIO_LIMIT (no overflow of exp)."""


# ------------------------------------------------------------------------------------------------------------- config
@dataclass
class RLConfig:
    """Settings of an RL run.

    Attributes:
        algorithm: "k25" (K2.5: advantage r - mean(r), token mask on the log-ratio, tau * log-ratio^2 penalty, loss
            normalised by the group's generated-token count) or "grpo" (advantage (r - mean) / std, PPO min/clip,
            k3 KL to a reference policy, per-sequence token mean).
        k: responses sampled per prompt (group size).
        alpha, beta: K2.5 keeps the policy gradient of tokens whose log-ratio `log pi_theta - log pi_old` lies in
            `[alpha, beta]` (inclusive) and zeroes it outside, whatever the advantage's sign; `alpha <= 0 <= beta`
            (ratio 1 is kept). The report leaves the values open; the defaults keep ratios in about [0.61, 1.65].
        tau: weight of the `tau * (log-ratio)^2` penalty (K2.5).
        penalty_on_masked: apply the penalty also on tokens outside `[alpha, beta]` (K2.5's Eq. 1 as written: the
            clip acts on the ratio term only). False zeroes every gradient of those tokens.
        clip_eps: GRPO's PPO clip range `[1 - eps, 1 + eps]`.
        kl_coef: GRPO's coefficient of the k3 KL to a reference model (0 with "k25"): > 0 needs one
            (`rl_iteration(ref_model=...)`, `RLStep(ref_model=...)`; the RL stage, `kimi-vl train rl`, loads its
            `--from` checkpoint as one, frozen).
        temperature, top_p: sampling settings (log-probs are of `softmax(logits / temperature)`).
        max_new_tokens: longest response.
        token_budget: reward budget in generated tokens (`kimi_vl.training.rewards.token_budget`); None = off.
        soft_budget: linear instead of hard cut-off beyond the budget.
        updates_per_batch: optimizer steps per rollout batch (> 1 makes the ratio differ from 1).
        micro_batch_size: sequences per forward / backward (memory bound); rollouts use the same for old log-probs.
        generation_batch_size: sequences per `generate` call (rounded down to whole groups, at least one group);
            None = all at once.
    """

    algorithm: str = "k25"
    k: int = 8
    alpha: float = -0.5
    beta: float = 0.5
    tau: float = 0.01
    penalty_on_masked: bool = True
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    token_budget: int | None = None
    soft_budget: bool = False
    updates_per_batch: int = 1
    micro_batch_size: int = 8
    generation_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm={self.algorithm!r}; choose one of {ALGORITHMS}.")
        if self.k < 2:
            raise ConfigError(f"k={self.k}: sample at least 2 responses per prompt; an advantage is a reward minus its "
                              "group's mean, 0 for every response of a group of one (K2.5 and GRPO need k >= 2).")
        for name in ("alpha", "beta", "tau", "kl_coef", "clip_eps", "temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)} must be a finite number.")
        if not self.alpha < self.beta:
            raise ConfigError(f"alpha={self.alpha} must be below beta={self.beta} (bounds of the kept log-ratios).")
        if not self.alpha <= 0 <= self.beta:
            hint = (f"; for ratios pi_theta / pi_old in [{self.alpha:g}, {self.beta:g}] pass alpha="
                    f"{math.log(self.alpha):.4g}, beta={math.log(self.beta):.4g}" if self.alpha > 0 else "")
            raise ConfigError(f"alpha={self.alpha}, beta={self.beta} bound the log-ratio log(pi_theta / pi_old) and "
                              "must include 0 (ratio 1: every token of a rollout batch's first update), or no token "
                              f"gets a policy gradient{hint}.")
        if self.tau < 0 or self.kl_coef < 0 or self.clip_eps <= 0:
            raise ConfigError(f"tau={self.tau} and kl_coef={self.kl_coef} must be >= 0 and clip_eps={self.clip_eps} "
                              "> 0.")
        if self.kl_coef > 0 and self.algorithm != "grpo":
            raise ConfigError(f"kl_coef={self.kl_coef} is GRPO's KL to a reference model, which algorithm="
                              f"{self.algorithm!r} has not (K2.5 regularises with tau * log-ratio^2, tau={self.tau}); "
                              "pass algorithm='grpo' (--algorithm grpo) or leave kl_coef at 0.")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"temperature={self.temperature} must be > 0 and top_p={self.top_p} in (0, 1]; RL "
                              "samples, so greedy decoding is not an option.")
        for name in ("max_new_tokens", "updates_per_batch", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1.")
        if self.token_budget is not None and self.token_budget < 1:
            raise ConfigError(f"token_budget={self.token_budget} must be a positive token count or None.")


# ------------------------------------------------------------------------------------------------------ pure functions
def group_advantages(rewards: torch.Tensor, normalise_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Advantages `[P, K]` from rewards `[P, K]` (row p = the K responses of prompt p).

    K2.5 (`normalise_std=False`): `A = r - mean_K(r)`. GRPO (`normalise_std=True`):
    `A = (r - mean_K(r)) / (std_K(r) + eps)` with the unbiased std (0 for K = 1, whose advantage is then 0).
    A group whose K rewards are all equal gets exactly 0 (the float32 mean of K equal values can be off by an ulp,
    which GRPO's division by `std + eps` would blow up to an advantage of about 0.1).
    """
    if rewards.ndim != 2:
        raise ShapeError(f"rewards must be [prompts, k], got shape {tuple(rewards.shape)}; reshape with .view(P, k).")
    rewards = rewards.float()
    constant = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).masked_fill(constant, 0.0)
    if not normalise_std:
        return centred
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(centred[:, :1])
    return centred / (std + eps)


def group_token_weights(mask: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """K2.5 normalisation `[N, T]`: `mask / (P * N_g)`, where `N_g` is the number of generated tokens of the token's
    group (K consecutive rows) and P the number of groups, so `sum(weights * l)` is the mean over prompts of each
    group's token-sum divided by its token count. `group_size=None`: all rows form one group (`mask / mask.sum()`).
    """
    mask = mask.float()
    n = mask.shape[0]
    k = n if group_size is None else int(group_size)
    if k < 1 or n % k:
        raise ShapeError(f"{n} rows do not split into groups of {group_size}; rows must be prompts x k.")
    groups = n // k
    counts = mask.view(groups, k, -1).sum(dim=(1, 2)).clamp(min=1.0)  # [P]
    return mask / (groups * counts.repeat_interleave(k)[:, None])


def sequence_token_weights(mask: torch.Tensor) -> torch.Tensor:
    """GRPO (DeepSeekMath) normalisation `[N, T]`: `mask / (N * |o_i|)`, the mean over sequences of each sequence's
    token mean."""
    mask = mask.float()
    return mask / (mask.shape[0] * mask.sum(dim=1, keepdim=True).clamp(min=1.0))


def clip_mask(log_ratio: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """K2.5's token-level clipping mask (bool, same shape): True where `alpha <= log_ratio <= beta`."""
    log_ratio = log_ratio.detach()
    return (log_ratio >= alpha) & (log_ratio <= beta)


def _check_shapes(**tensors: torch.Tensor | None) -> None:
    shape = tensors["logp"].shape
    if len(shape) != 2:
        raise ShapeError(f"logp must be [sequences, tokens], got shape {tuple(shape)}.")
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ShapeError(f"{name} has shape {tuple(t.shape)}; expected logp's {tuple(shape)}.")


def _advantage_per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    advantages = advantages.to(like)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    if advantages.shape[0] != like.shape[0] or advantages.shape[1] not in (1, like.shape[1]):
        raise ShapeError(f"advantages have shape {tuple(advantages.shape)}; expected [{like.shape[0]}] (one per "
                         f"sequence) or {tuple(like.shape)} (one per token).")
    return advantages.expand_as(like)


def k25_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    beta: float,
    tau: float,
    *,
    group_size: int | None = None,
    weights: torch.Tensor | None = None,
    penalty_on_masked: bool = True,
) -> torch.Tensor:
    """Kimi K2.5 policy loss (to minimise), a scalar.

    With `lr = logp - old_logp` (token log-ratio, `[N, T]`), `rho = exp(lr)`, `m = 1{alpha <= lr <= beta}` (no
    gradient through m), advantage `A` per sequence (`[N]`) or token (`[N, T]`) and weights `w` (default
    `group_token_weights(mask, group_size)`: `1 / (P * N_g)` on generated tokens, N_g = the group's token count):

        loss = sum_{j,i} w_{j,i} * ( - m_{j,i} * rho_{j,i} * A_j  +  tau * lr_{j,i}^2 )

    i.e. minus K2.5's Eq. 1 objective. Gradient w.r.t. `logp` per token: `w * (-m * rho * A + 2 * tau * lr)`, so
    - with all ratios 1 (`old_logp = logp.detach()`) and `tau = 0` it is the plain policy gradient of
      `-sum w * A * logp`;
    - tokens outside `[alpha, beta]` get exactly zero policy gradient for either sign of A (their ratio is
      evaluated at `lr = 0` so an overflowing exp cannot turn into NaN); with `penalty_on_masked=False` they also get
      no penalty gradient, i.e. exactly zero gradient;
    - the penalty's gradient is `w * 2 * tau * lr`.
    `weights`, when given, replaces the default (e.g. a slice of weights computed over the whole batch, so micro-batch
    losses add up to the full-batch loss).
    """
    _check_shapes(logp=logp, old_logp=old_logp, mask=mask, weights=weights)
    w = group_token_weights(mask, group_size) if weights is None else weights.float()
    adv = _advantage_per_token(advantages, logp)
    log_ratio = logp.float() - old_logp.float()
    keep = clip_mask(log_ratio, alpha, beta)
    safe = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    policy = -keep.float() * torch.exp(safe) * adv.float()
    penalty = tau * log_ratio.square()
    if not penalty_on_masked:
        penalty = torch.where(keep, penalty, torch.zeros_like(penalty))
    return (w * (policy + penalty)).sum()


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO (DeepSeekMath) loss (to minimise), a scalar, for comparison with `k25_loss`.

    With `rho = exp(logp - old_logp)` (log-ratio clamped to +-20), advantages `A` (std-normalised by
    `group_advantages(..., normalise_std=True)`), weights `w` (default `sequence_token_weights(mask)`:
    `1 / (N * |o_i|)`) and the k3 estimator `KL = exp(ref - logp) - (ref - logp) - 1`:

        loss = sum_{j,i} w_{j,i} * ( - min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) + kl_coef * KL_{j,i} )

    The KL term needs `ref_logp` when `kl_coef > 0`.
    """
    _check_shapes(logp=logp, old_logp=old_logp, mask=mask, weights=weights, ref_logp=ref_logp)
    if kl_coef > 0 and ref_logp is None:
        raise ConfigError("kl_coef > 0 needs ref_logp: pass ref_model to rollout (or set kl_coef=0).")
    w = sequence_token_weights(mask) if weights is None else weights.float()
    adv = _advantage_per_token(advantages, logp).float()
    log_ratio = (logp.float() - old_logp.float()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    if kl_coef > 0:
        delta = ref_logp.float() - logp.float()
        per_token = per_token + kl_coef * (torch.exp(delta) - delta - 1)
    return (w * per_token).sum()


# -------------------------------------------------------------------------------------------------------------- update
def _reward_tensor(rewards: torch.Tensor | Sequence[float], rollouts: Rollouts) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
    expected = rollouts.num_prompts * rollouts.group_size
    if r.numel() != expected:
        raise ShapeError(f"got {r.numel()} rewards for {rollouts.num_prompts} prompts x {rollouts.group_size} "
                         f"responses = {expected}; pass one reward per response ([P, K] or [N]).")
    return r.reshape(rollouts.num_prompts, rollouts.group_size)


@dataclass
class RLBatch:
    """Rollouts ready for updates: advantages `[N]` and per-token loss weights `[N, T]` over the whole batch (so that
    micro-batch losses add up to the full-batch loss), from rewards `[P, K]`."""

    rollouts: Rollouts
    rewards: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor

    @classmethod
    def build(cls, rollouts: Rollouts, rewards: torch.Tensor | Sequence[float], cfg: RLConfig) -> RLBatch:
        r = _reward_tensor(rewards, rollouts)
        grpo = cfg.algorithm == "grpo"
        if grpo and cfg.kl_coef > 0 and rollouts.ref_logp is None:
            raise ConfigError("GRPO with kl_coef > 0 needs reference log-probs: pass ref_model to rollout.")
        mask = rollouts.response_mask
        advantages = group_advantages(r, normalise_std=grpo).reshape(-1).to(mask.device)
        weights = sequence_token_weights(mask) if grpo else group_token_weights(mask, rollouts.group_size)
        return cls(rollouts, r, advantages, weights)


def rl_backward(
    model: nn.Module,
    batch: RLBatch,
    cfg: RLConfig,
    *,
    with_entropy: bool = True,
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> dict[str, float]:
    """The gradients of one update on `batch` (accumulated into `.grad` over micro-batches of
    `cfg.micro_batch_size` rows; no optimizer step). `no_sync()` wraps every micro-batch but the last (data-parallel
    gradient sync once), `autocast()` every forward, `backward(loss)` replaces `loss.backward()` (accelerate's).

    Returns sums over the batch's response tokens: `loss` (the batch loss), `tokens`, `masked` (tokens with no policy
    gradient: K2.5 log-ratio outside `[alpha, beta]`, GRPO ratio outside `[1 - eps, 1 + eps]`), `log_ratio_abs` and,
    with `with_entropy`, `entropy` (of the sampling distribution)."""
    grpo = cfg.algorithm == "grpo"
    rollouts = batch.rollouts
    was_training = model.training
    model.train()
    totals: dict[str, float] = defaultdict(float)
    groups = rollouts.micro_batches(cfg.micro_batch_size)
    try:
        for i, rows in enumerate(groups):
            sl = slice(rows.start, rows.stop)
            inputs = rollouts.model_inputs(rows)
            mb_mask = inputs.pop("response_mask")
            t = mb_mask.shape[1]
            with no_sync() if i < len(groups) - 1 else contextlib.nullcontext(), autocast():
                out = token_logprobs(model, inputs.pop("input_ids"), inputs.pop("attention_mask"), mb_mask,
                                     temperature=rollouts.temperature, with_entropy=with_entropy,
                                     suppress_token_ids=rollouts.suppress_token_ids, **inputs)
                logp, entropy = out if with_entropy else (out, None)
                old = rollouts.old_logp[sl, :t]
                if grpo:
                    ref = None if rollouts.ref_logp is None else rollouts.ref_logp[sl, :t]
                    loss = grpo_loss(logp, old, batch.advantages[sl], mb_mask, cfg.clip_eps, ref_logp=ref,
                                     kl_coef=cfg.kl_coef, weights=batch.weights[sl, :t])
                else:
                    loss = k25_loss(logp, old, batch.advantages[sl], mb_mask, cfg.alpha, cfg.beta, cfg.tau,
                                    weights=batch.weights[sl, :t], penalty_on_masked=cfg.penalty_on_masked)
                backward(loss)
            with torch.no_grad():
                log_ratio = (logp.detach() - old) * mb_mask
                if grpo:
                    ratio = torch.exp(log_ratio)
                    masked = ((ratio < 1 - cfg.clip_eps) | (ratio > 1 + cfg.clip_eps)) & mb_mask.bool()
                else:
                    masked = ~clip_mask(log_ratio, cfg.alpha, cfg.beta) & mb_mask.bool()
                totals["loss"] += float(loss.detach())
                totals["masked"] += float(masked.sum())
                totals["log_ratio_abs"] += float(log_ratio.abs().sum())
                totals["tokens"] += float(mb_mask.sum())
                if entropy is not None:
                    totals["entropy"] += float(entropy.sum())
    finally:
        model.train(was_training)
    return dict(totals)


def rollout_metrics(rewards: torch.Tensor, advantages: torch.Tensor, lengths: torch.Tensor,
                    truncated: torch.Tensor, tasks: Sequence[str]) -> dict[str, float]:
    """Metrics of a rollout batch from rewards `[P, K]`, advantages `[N]`, response lengths `[N]`, truncation
    flags `[N]` and each row's task: `reward_mean`, `reward_std`, `reward/<task>`, `advantage_abs_mean`,
    `zero_advantage_groups` (fraction of groups whose rewards are all equal: no learning signal),
    `response_length`, `truncated_fraction`."""
    r = rewards.float()
    metrics = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "advantage_abs_mean": float(advantages.abs().mean()),
        "zero_advantage_groups": float((r.max(dim=1).values == r.min(dim=1).values).float().mean()),
        "response_length": float(lengths.float().mean()),
        "truncated_fraction": float(truncated.float().mean()),
    }
    by_task: dict[str, list[float]] = defaultdict(list)
    for task, value in zip(tasks, r.reshape(-1).tolist()):
        by_task[str(task)].append(value)
    for task, values in sorted(by_task.items()):
        metrics[f"reward/{task}"] = sum(values) / len(values)
    return metrics


def _update_metrics(totals: dict[str, float]) -> dict[str, float]:
    tokens = max(totals["tokens"], 1.0)
    out = {"masked_fraction": totals["masked"] / tokens, "log_ratio_abs_mean": totals["log_ratio_abs"] / tokens}
    if "entropy" in totals:
        out["entropy"] = totals["entropy"] / tokens
    return out


def rl_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Rollouts,
    rewards: torch.Tensor | Sequence[float],
    cfg: RLConfig,
    *,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """`cfg.updates_per_batch` optimizer steps on `rollouts` with `rewards` (`[P, K]` or `[N]`), for loops of your own
    (the `Trainer` runs `RLStep`): per step, zero the gradients, `rl_backward`, clip the gradient norm to
    `max_grad_norm`, step. Old log-probs come from the rollout-time policy, so the ratio is 1 on the first step and
    differs only on later steps of the same batch.

    Returns `rollout_metrics` plus `loss` (mean over steps), `masked_fraction` and `log_ratio_abs_mean` (mean over
    steps), `entropy` (first step), `grad_norm` (last step; with clipping) and `updates`."""
    batch = RLBatch.build(rollouts, rewards, cfg)
    totals: dict[str, float] = defaultdict(float)
    entropy, grad_norm = None, None
    for update in range(cfg.updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        out = rl_backward(model, batch, cfg, with_entropy=update == 0)
        if update == 0:
            entropy = out.pop("entropy") / max(out["tokens"], 1.0)
        for key, value in out.items():
            totals[key] += value
        if max_grad_norm is not None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        optimizer.step()
    metrics = {"loss": totals["loss"] / cfg.updates_per_batch, **_update_metrics(totals), "entropy": entropy,
               "updates": float(cfg.updates_per_batch),
               **rollout_metrics(batch.rewards, batch.advantages, rollouts.lengths, rollouts.truncated,
                                 [getattr(s, "task", "unknown") for s in rollouts.row_samples()])}
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm if math.isfinite(grad_norm) else float("nan")
    return metrics


def rl_iteration(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    processor: Any,
    samples: Sequence[Any],
    cfg: RLConfig,
    *,
    seed: int | None = None,
    reward_fn: Callable[..., float] | None = None,
    ref_model: nn.Module | None = None,
    processor_kwargs: dict | None = None,
    max_grad_norm: float | None = 1.0,
) -> tuple[dict[str, float], Rollouts]:
    """One RL iteration for loops of your own: `rollout` (settings from `cfg`), rewards (`Rollouts.rewards`, with
    `cfg.token_budget`), `rl_step`. Returns `(metrics, rollouts)`."""
    rollouts = rollout(
        model, processor, samples, k=cfg.k, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, seed=seed, micro_batch_size=cfg.micro_batch_size,
        generation_batch_size=cfg.generation_batch_size, ref_model=ref_model, processor_kwargs=processor_kwargs,
    )
    rewards = rollouts.rewards(reward_fn, token_budget=cfg.token_budget, soft_budget=cfg.soft_budget)
    metrics = rl_step(model, optimizer, rollouts, rewards, cfg, max_grad_norm=max_grad_norm)
    return metrics, rollouts


# ----------------------------------------------------------------------------------------------------- the trainer's
PromptSource = Callable[[int], tuple[list[Any], list[dict[str, Any]]]]
"""`index -> (prompts, bad records)`: the global prompts of rollout batch `index` (a pure function of it)."""


class RLStep:
    """RL as the `Trainer`'s step: every `cfg.updates_per_batch` optimizer steps a rollout batch, and each optimizer
    step one update on it (`rl_backward`). Optimizer step `s` belongs to rollout batch `s // updates_per_batch`; the
    first step of a batch reports its bad records and, for prompts with a `source` (users' data), `documents`: the
    prompts drawn per source.

    Rollout batch `b` takes the global prompts `prompts(b)`; with `W` data-parallel processes, rank `r` takes the
    `r`-th contiguous share of them and generates their `cfg.k` responses (`rollout` with the prompts' global
    indices and seed `seed * 1_000_003 + b`: the same responses as one process would sample for them). Each rank's
    loss is normalised over its own share, so the data-parallel mean of the gradients is the global batch's (K2.5:
    `1 / (P * N_g)` per token; GRPO: `1 / (N * |o_i|)`). Metrics are the global batch's. Checkpoints are taken only at
    rollout-batch boundaries (a resumed run regenerates the batch with the restored model). `ref_model` (frozen, on
    the trainer's device) gives GRPO's reference log-probs; `cfg.kl_coef > 0` needs it.
    """

    def __init__(self, prompts: PromptSource, processor: Any, cfg: RLConfig, *, seed: int,
                 reward_fn: Callable[..., float] | None = None, ref_model: nn.Module | None = None) -> None:
        if cfg.algorithm == "grpo" and cfg.kl_coef > 0 and ref_model is None:
            raise ConfigError(f"kl_coef={cfg.kl_coef} needs a reference model: pass ref_model (the RL stage, "
                              "kimi-vl train rl, passes its --from checkpoint), or set kl_coef to 0.")
        self.prompts, self.processor, self.cfg, self.seed, self.reward_fn = prompts, processor, cfg, seed, reward_fn
        self.ref_model = ref_model
        self.batch: RLBatch | None = None
        self.metrics: dict[str, float] = {}
        self.bad_records: list[dict[str, Any]] = []

    def start(self, trainer: Any) -> None:
        self.batch = None
        if self.ref_model is not None:
            self.ref_model.to(trainer.accelerator.device)

    def can_checkpoint(self, step: int) -> bool:
        return step % self.cfg.updates_per_batch == 0

    def finish(self) -> None:
        self.batch = None  # the last rollout batch

    def backward(self, trainer: Any) -> dict[str, Any]:
        cfg, acc = self.cfg, trainer.accelerator
        first = trainer.step % cfg.updates_per_batch == 0 or self.batch is None
        bad: list[dict[str, Any]] = []
        documents: dict[str, int] = {}
        if first:
            bad, documents = self._roll(trainer, trainer.step // cfg.updates_per_batch)
        totals = rl_backward(trainer.model, self.batch, cfg, with_entropy=first,
                             no_sync=lambda: acc.no_sync(trainer.model), autocast=acc.autocast,
                             backward=acc.backward)
        keys = sorted(totals)
        stats = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            torch.distributed.all_reduce(stats)
        totals = dict(zip(keys, stats.tolist()))
        return {"loss": totals["loss"] / acc.num_processes, "tokens": int(totals["tokens"]), **self.metrics,
                **_update_metrics(totals), "bad_records": bad, **({"documents": documents} if documents else {})}

    def _roll(self, trainer: Any, index: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """Rollout batch `index`: this rank's share of its prompts, their responses, rewards and loss weights.
        Returns the batch's bad records and its prompts per source."""
        cfg, acc = self.cfg, trainer.accelerator
        prompts, bad = self.prompts(index)
        documents = dict(Counter(source for p in prompts if (source := getattr(p, "source", ""))))
        world, rank = acc.num_processes, acc.process_index
        if len(prompts) % world:
            raise ConfigError(f"{len(prompts)} prompts per step do not split over {world} processes; make the prompts "
                              "of a rollout batch a multiple of the number of processes (users' data: "
                              "--prompts-per-step; the embedded data: --prompts-per-family times the number of "
                              "--families).")
        share = len(prompts) // world
        local = range(rank * share, (rank + 1) * share)
        rollouts = rollout(
            trainer.raw_model, self.processor, [prompts[i] for i in local], k=cfg.k,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            seed=self.seed * 1_000_003 + index, micro_batch_size=cfg.micro_batch_size,
            generation_batch_size=cfg.generation_batch_size, prompt_indices=local, autocast=acc.autocast,
            synced_gpus=world > 1 and acc.distributed_type.value == "FSDP", ref_model=self.ref_model)
        rewards = rollouts.rewards(self.reward_fn, token_budget=cfg.token_budget, soft_budget=cfg.soft_budget)
        self.batch = RLBatch.build(rollouts, rewards, cfg)
        parts = [(self.batch.rewards, self.batch.advantages.cpu(), rollouts.lengths.cpu(), rollouts.truncated.cpu(),
                  [getattr(s, "task", "unknown") for s in rollouts.row_samples()])]
        if world > 1:
            gathered: list[Any] = [None] * world
            torch.distributed.all_gather_object(gathered, parts[0])
            parts = gathered
        self.metrics = {"rollout": index, **rollout_metrics(
            torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]),
            torch.cat([p[3] for p in parts]), [t for p in parts for t in p[4]])}
        return bad, documents


__all__ = [
    "ALGORITHMS", "PromptSource", "RLBatch", "RLConfig", "RLStep", "clip_mask", "group_advantages",
    "group_token_weights", "grpo_loss", "k25_loss", "rl_backward", "rl_iteration", "rl_step", "rollout_metrics",
    "sequence_token_weights",
]
