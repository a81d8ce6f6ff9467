"""RL core: rollouts with the cache, group advantages, the K2.5 policy loss (and GRPO for comparison), one update.

One RL iteration (`rl_iteration`) is

1. `rollout`: for each of P prompts (chat template, images / videos included) sample K responses with
   `model.generate(do_sample=True)` and the hybrid cache; record the **old-policy** token log-probs right after
   sampling with the same model in eval mode (`Rollouts.old_logp`, one forward per micro-batch);
2. score every response with a verifiable reward (`kimi_vl.training.rewards.reward`, optional token budget) ->
   rewards `[P, K]`;
3. `rl_step`: advantages per group, then `updates_per_batch` optimizer steps over the rollouts in micro-batches.

Old log-probs come from the rollout-time policy and are computed with exactly the inputs (micro-batches, padding)
`rl_step` uses, so on the first update of a batch the ratio `pi_theta / pi_old` is 1 (exactly, on deterministic
kernels) and the K2.5 loss is the plain policy gradient with the group-mean baseline; the ratio, the clipping mask
and the squared log-ratio penalty only act when several updates are made per batch (`updates_per_batch > 1`), or
when the old log-probs come from a different engine than the trainer (K2.5's train/inference mismatch).

Log-probs are those of the sampling distribution `softmax(logits / temperature)` (top-k is off; with
`top_p < 1` the nucleus truncation is not reflected in the recorded log-probs, as in TRL).

Shapes: N = P * K sequences, the K responses of prompt p in rows `p*K .. p*K + K-1`; T = longest response.
`response_mask [N, T]` is 1 on generated tokens up to and including the first end token (`<|im_end|>` or `[EOS]`),
0 after it; a response without an end token within `max_new_tokens` is kept whole (`Rollouts.truncated`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..data.encode import MEDIA_KEYS, encode_prompt, end_token_ids, left_pad, tokenizer_of
from ..errors import ConfigError, ShapeError
from ..fusion.tokenizer import MEDIA_PAD, VIDEO_PLACEHOLDER
from . import rewards as _rewards

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
            `[alpha, beta]` (inclusive) and zeroes it outside, whatever the advantage's sign. The report leaves the
            values open; the defaults keep ratios in about [0.61, 1.65].
        tau: weight of the `tau * (log-ratio)^2` penalty (K2.5).
        penalty_on_masked: apply the penalty also on tokens outside `[alpha, beta]` (K2.5's Eq. 1 as written: the
            clip acts on the ratio term only). False zeroes every gradient of those tokens.
        clip_eps: GRPO's PPO clip range `[1 - eps, 1 + eps]`.
        kl_coef: GRPO's coefficient of the k3 KL to the reference model (needs `ref_model` at rollout when > 0).
        temperature, top_p: sampling settings (log-probs are of `softmax(logits / temperature)`).
        max_new_tokens: longest response.
        token_budget: reward budget in generated tokens (`kimi_vl.training.rewards.token_budget`); None = off.
        soft_budget: linear instead of hard cut-off beyond the budget.
        updates_per_batch: optimizer steps per rollout batch (> 1 makes the ratio differ from 1).
        micro_batch_size: sequences per forward / backward (memory bound); rollouts use the same for old log-probs.
        generation_batch_size: sequences per `generate` call (rounded down to whole groups, at least one group);
            None = all at once.
        max_grad_norm: gradient-norm clipping before each optimizer step; None = off.
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
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm={self.algorithm!r}; choose one of {ALGORITHMS}.")
        if self.k < 1:
            raise ConfigError(f"k={self.k}: sample at least one response per prompt (K2.5 and GRPO need k >= 2).")
        if not self.alpha < self.beta:
            raise ConfigError(f"alpha={self.alpha} must be below beta={self.beta} (bounds of the kept log-ratios).")
        if self.tau < 0 or self.kl_coef < 0 or self.clip_eps <= 0:
            raise ConfigError(f"tau={self.tau} and kl_coef={self.kl_coef} must be >= 0 and clip_eps={self.clip_eps} "
                              "> 0.")
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
    """
    if rewards.ndim != 2:
        raise ShapeError(f"rewards must be [prompts, k], got shape {tuple(rewards.shape)}; reshape with .view(P, k).")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
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


# --------------------------------------------------------------------------------------------------------- log-probs
def _accepts_media(model: nn.Module) -> bool:
    return "pixel_values" in inspect.signature(model.forward).parameters


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    suppress_token_ids: Sequence[int] = (),
    **media: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[N, T]` of the response tokens under `model` (one forward; gradients flow when enabled).

    `input_ids [N, L]` holds prompt + response with the responses in the last `T = response_mask.shape[1]` columns
    (left-padded prompts, `attention_mask [N, L]`); `media` are the model's media inputs (`pixel_values`, ...).
    Only the last `T + 1` positions go through the LM head (`logits_to_keep`); in fp32,
    `logp = logits[y] / temperature - logsumexp(logits / temperature)`, set to 0 where `response_mask` is 0.
    `with_entropy=True` also returns the token entropy `[N, T]` of `softmax(logits / temperature)` (no gradient).
    `suppress_token_ids` get logit -inf, as they did when sampling (`rollout` suppresses the media placeholders).
    """
    if input_ids.ndim != 2 or response_mask.ndim != 2 or response_mask.shape[0] != input_ids.shape[0]:
        raise ShapeError(f"input_ids {tuple(input_ids.shape)} and response_mask {tuple(response_mask.shape)} must be "
                         "[N, L] and [N, T] with the same N.")
    T = response_mask.shape[1]
    if T >= input_ids.shape[1]:
        raise ShapeError(f"the response ({T} tokens) must follow a prompt of at least one token in input_ids "
                         f"{tuple(input_ids.shape)}.")
    media = {k: v for k, v in media.items() if v is not None}
    if media and not _accepts_media(model):
        raise ConfigError(f"{type(model).__name__} takes no media but the inputs hold {sorted(media)}; use "
                          "KimiVLForConditionalGeneration for image / video prompts.")
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=T + 1, **media)
    logits = out.logits[:, :-1].float()
    if len(suppress_token_ids):
        logits = logits.index_fill(-1, torch.tensor(list(suppress_token_ids), device=logits.device), -math.inf)
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -T:]
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    keep = response_mask.bool()
    logp = torch.where(keep, logp, torch.zeros_like(logp))
    if not with_entropy:
        return logp
    with torch.no_grad():
        probs = torch.softmax(logits.detach(), dim=-1)
        entropy = lse.detach() - (probs * logits.detach().nan_to_num(neginf=0.0)).sum(-1)
        entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
    return logp, entropy


# ----------------------------------------------------------------------------------------------------------- rollouts
@dataclass
class Rollouts:
    """K sampled responses for each of P prompts, with what an update needs.

    Attributes:
        samples: the P prompts' samples (duck-typed `Sample`: `question`, `image`, `video`, `reward`, `answer`, ...).
        group_size: K; row `n` belongs to prompt `n // K`.
        prompts: P unpadded prompt id tensors `[L_p]` (chat template with the generation prompt).
        media: P dicts of the prompt's media tensors (`MEDIA_KEYS`; empty for text prompts).
        response_ids: `[N, T]` generated ids, padding after the end token.
        response_mask: `[N, T]` float, 1 on generated tokens up to and including the end token.
        old_logp: `[N, T]` fp32 log-probs of the rollout-time policy (0 off the mask).
        ref_logp: `[N, T]` log-probs of the reference model (GRPO KL), or None.
        texts: N decoded responses (up to the end token, special tokens skipped).
        truncated: `[N]` bool, True where no end token came within `max_new_tokens`.
        pad_token_id: id used for padding.
        temperature: the sampling temperature (log-probs are recomputed with it).
        micro_batch_size: rows per forward used for `old_logp` (`rl_step` should use the same).
        suppress_token_ids: ids that could not be sampled (the media placeholders: a generated placeholder would
            be taken for a media slot when the sequence is re-encoded), masked out of every recomputed log-prob.
    """

    samples: list[Any]
    group_size: int
    prompts: list[torch.Tensor]
    media: list[dict[str, torch.Tensor]]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    old_logp: torch.Tensor
    texts: list[str]
    truncated: torch.Tensor
    pad_token_id: int
    temperature: float = 1.0
    micro_batch_size: int = 8
    ref_logp: torch.Tensor | None = None
    suppress_token_ids: tuple[int, ...] = ()

    @property
    def num_prompts(self) -> int:
        return len(self.samples)

    @property
    def num_sequences(self) -> int:
        return self.response_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """`[N]` generated tokens per response (end token included)."""
        return self.response_mask.sum(dim=1).long()

    def row_samples(self) -> list[Any]:
        """The sample of every row (N entries)."""
        return [s for s in self.samples for _ in range(self.group_size)]

    def micro_batches(self, size: int | None = None) -> list[range]:
        size = size or self.micro_batch_size
        return [range(i, min(i + size, self.num_sequences)) for i in range(0, self.num_sequences, size)]

    def model_inputs(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Forward inputs for `rows`: `input_ids` / `attention_mask` `[n, L + T']` (prompts left-padded to their
        longest, responses cut to their longest `T'`), the rows' media concatenated in row order, and
        `response_mask [n, T']` (what `token_logprobs` takes)."""
        rows = list(rows)
        device = self.response_ids.device
        lengths = self.response_mask[rows].sum(dim=1)
        t = max(1, int(lengths.max().item()))
        prompts = [self.prompts[r // self.group_size] for r in rows]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long, device=device)
        attn = torch.zeros((len(rows), width + t), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = p.to(device)
            attn[i, width - len(p):] = 1
        attn[:, width:] = 1  # causal: the padding after an end token cannot affect earlier tokens
        inputs = {
            "input_ids": torch.cat([ids, self.response_ids[rows, :t]], dim=1),
            "attention_mask": attn,
            "response_mask": self.response_mask[rows, :t],
        }
        for key in MEDIA_KEYS:
            parts = [self.media[r // self.group_size][key] for r in rows if key in self.media[r // self.group_size]]
            if parts:
                inputs[key] = torch.cat(parts, dim=0).to(device)
        return inputs

    def rewards(self, reward_fn: Callable[..., float] | None = None, *, token_budget: int | None = None,
                soft_budget: bool = False) -> torch.Tensor:
        """Rewards `[P, K]`: `reward_fn(sample, text, num_tokens=...)` per response (default
        `kimi_vl.training.rewards.reward` with `max_tokens=token_budget`)."""
        lengths = self.lengths.tolist()
        values = []
        for n, (sample, text) in enumerate(zip(self.row_samples(), self.texts)):
            if reward_fn is None:
                kw = {} if token_budget is None else {"max_tokens": token_budget, "num_tokens": lengths[n]}
                values.append(_rewards.reward(sample, text, soft_budget=soft_budget, **kw))
            else:
                values.append(float(reward_fn(sample, text, num_tokens=lengths[n])))
        return torch.tensor(values, dtype=torch.float32).view(self.num_prompts, self.group_size)

    def to(self, device: torch.device | str) -> Rollouts:
        """The rollouts with every tensor moved to `device`."""
        move = lambda t: None if t is None else t.to(device)
        return replace(
            self, prompts=[move(p) for p in self.prompts],
            media=[{k: move(v) for k, v in m.items()} for m in self.media], response_ids=move(self.response_ids),
            response_mask=move(self.response_mask), old_logp=move(self.old_logp), truncated=move(self.truncated),
            ref_logp=move(self.ref_logp),
        )


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def policy_logprobs(model: nn.Module, rollouts: Rollouts, micro_batch_size: int | None = None) -> torch.Tensor:
    """`[N, T]` log-probs of the rollouts' responses under `model` (eval mode, no gradient), computed on the same
    micro-batches as `rl_step` (so they match the first update's log-probs)."""
    was_training = model.training
    model.eval()
    try:
        out = torch.zeros_like(rollouts.response_mask, dtype=torch.float32)
        for rows in rollouts.micro_batches(micro_batch_size):
            inputs = rollouts.model_inputs(rows)
            mask = inputs.pop("response_mask")
            logp = token_logprobs(model, inputs.pop("input_ids"), inputs.pop("attention_mask"), mask,
                                  temperature=rollouts.temperature,
                                  suppress_token_ids=rollouts.suppress_token_ids, **inputs)
            out[rows.start:rows.stop, : mask.shape[1]] = logp.float()
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def rollout(
    model: nn.Module,
    processor: Any,
    samples: Sequence[Any],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    micro_batch_size: int = 8,
    generation_batch_size: int | None = None,
    ref_model: nn.Module | None = None,
    processor_kwargs: dict | None = None,
) -> Rollouts:
    """Sample `k` responses per sample with `model.generate(do_sample=True)` (hybrid cache) and record the
    old-policy log-probs.

    Prompts are built with `encode_prompt` (chat template; images and videos through the processor) and left-padded
    per generation batch (`generation_batch_size` sequences, rounded down to whole groups; default all). Sampling is
    `softmax(logits / temperature)` (top-k off, nucleus `top_p`), with the global torch RNG seeded by `seed` inside a
    forked RNG state when given (the caller's RNG state is left untouched). Generation stops at `<|im_end|>` or
    `[EOS]`. Right after sampling, the same model in eval mode computes `old_logp` (`policy_logprobs`, micro-batches
    of `micro_batch_size` rows); `ref_model`, when given, gives `ref_logp` the same way. The model's train/eval mode
    is restored on return.
    """
    if k < 1 or max_new_tokens < 1:
        raise ConfigError(f"k={k} and max_new_tokens={max_new_tokens} must both be at least 1.")
    if not samples:
        raise ConfigError("rollout got no samples; pass at least one prompt.")
    tok = tokenizer_of(processor)
    ends = end_token_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else ends[0]
    suppress = tuple(i for i in tok.convert_tokens_to_ids([MEDIA_PAD, VIDEO_PLACEHOLDER])
                     if i is not None and i != tok.unk_token_id)
    device = _model_device(model)
    encoded = [encode_prompt(s, processor, processor_kwargs) for s in samples]
    if any(media for _, media in encoded) and not _accepts_media(model):
        raise ConfigError(f"{type(model).__name__} takes no media but some samples have images or videos; use "
                          "KimiVLForConditionalGeneration or text-only samples.")
    per_call = len(samples) if generation_batch_size is None else max(1, generation_batch_size // k)

    was_training = model.training
    model.eval()
    responses: list[torch.Tensor] = []
    try:
        with _seeded(seed, device):
            for start in range(0, len(samples), per_call):
                group = encoded[start : start + per_call]
                batch = left_pad([row for row in group for _ in range(k)], pad, device)
                width = batch["input_ids"].shape[1]
                out = model.generate(
                    **batch, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                    max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=ends, use_cache=True,
                    suppress_tokens=list(suppress) or None,
                )
                responses.append(out[:, width:].cpu())
    finally:
        model.train(was_training)

    T = max(r.shape[1] for r in responses)
    response_ids = torch.cat([nn.functional.pad(r, (0, T - r.shape[1]), value=pad) for r in responses])
    is_end = torch.isin(response_ids, torch.tensor(ends))
    has_end = is_end.any(dim=1)
    first_end = torch.where(has_end, is_end.float().argmax(dim=1), torch.full_like(has_end, T, dtype=torch.long))
    positions = torch.arange(T)[None, :]
    length = torch.where(has_end, first_end + 1, torch.full_like(first_end, T))
    response_mask = (positions < length[:, None]).float()
    response_ids = response_ids.masked_fill(response_mask == 0, pad)
    texts = [tok.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
             for ids, n in zip(response_ids, torch.where(has_end, first_end, length))]
    result = Rollouts(
        samples=list(samples), group_size=k, prompts=[ids for ids, _ in encoded], media=[m for _, m in encoded],
        response_ids=response_ids, response_mask=response_mask, old_logp=torch.zeros_like(response_mask),
        texts=texts, truncated=~has_end, pad_token_id=pad, temperature=temperature,
        micro_batch_size=micro_batch_size, suppress_token_ids=suppress,
    ).to(device)
    result.old_logp = policy_logprobs(model, result)
    if ref_model is not None:
        result.ref_logp = policy_logprobs(ref_model, result)
    return result


# -------------------------------------------------------------------------------------------------------------- update
def _reward_tensor(rewards: torch.Tensor | Sequence[float], rollouts: Rollouts) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
    expected = rollouts.num_prompts * rollouts.group_size
    if r.numel() != expected:
        raise ShapeError(f"got {r.numel()} rewards for {rollouts.num_prompts} prompts x {rollouts.group_size} "
                         f"responses = {expected}; pass one reward per response ([P, K] or [N]).")
    return r.reshape(rollouts.num_prompts, rollouts.group_size)


def rl_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Rollouts,
    rewards: torch.Tensor | Sequence[float],
    cfg: RLConfig,
) -> dict[str, float]:
    """`cfg.updates_per_batch` optimizer steps on `rollouts` with `rewards` (`[P, K]` or `[N]`).

    Advantages: `group_advantages` (std-normalised for GRPO). Per step: zero the gradients, run the rollouts in
    micro-batches of `cfg.micro_batch_size` rows, backpropagate each micro-batch's share of the loss (weights are
    computed over the whole batch, so the accumulated gradient is the full-batch gradient), clip the gradient norm,
    step. Old log-probs come from the rollout-time policy, so the ratio is 1 on the first step and differs only on
    later steps of the same batch: exactly 1 when the rollouts were made with the same `micro_batch_size` (as
    `rl_iteration` does; the forwards then see identical inputs), otherwise up to the float rounding of different
    padding.

    Returns metrics (floats): `loss` (mean over steps), `reward_mean`, `reward_std`, `reward/<task>` (mean per
    `sample.task`), `advantage_abs_mean`, `zero_advantage_groups` (fraction of groups whose rewards are all equal:
    no learning signal), `response_length` (mean generated tokens), `truncated_fraction`, `masked_fraction`
    (fraction of response tokens with no policy gradient: K2.5 log-ratio outside `[alpha, beta]`, GRPO ratio outside
    `[1 - eps, 1 + eps]`; mean over steps), `log_ratio_abs_mean` (mean over steps), `entropy` (mean token entropy of
    the sampling distribution on the first step), `grad_norm` (last step; when clipping is on), `updates`.
    """
    r = _reward_tensor(rewards, rollouts)
    grpo = cfg.algorithm == "grpo"
    device = rollouts.response_mask.device
    advantages = group_advantages(r, normalise_std=grpo).reshape(-1).to(device)
    mask = rollouts.response_mask
    weights = sequence_token_weights(mask) if grpo else group_token_weights(mask, rollouts.group_size)
    num_tokens = float(mask.sum().clamp(min=1.0))
    if grpo and cfg.kl_coef > 0 and rollouts.ref_logp is None:
        raise ConfigError("GRPO with kl_coef > 0 needs reference log-probs: pass ref_model to rollout.")

    was_training = model.training
    model.train()
    totals: dict[str, float] = defaultdict(float)
    grad_norm = None
    try:
        for update in range(cfg.updates_per_batch):
            optimizer.zero_grad(set_to_none=True)
            for rows in rollouts.micro_batches(cfg.micro_batch_size):
                sl = slice(rows.start, rows.stop)
                inputs = rollouts.model_inputs(rows)
                mb_mask = inputs.pop("response_mask")
                t = mb_mask.shape[1]
                first = update == 0
                out = token_logprobs(model, inputs.pop("input_ids"), inputs.pop("attention_mask"), mb_mask,
                                     temperature=rollouts.temperature, with_entropy=first,
                                     suppress_token_ids=rollouts.suppress_token_ids, **inputs)
                logp, entropy = out if first else (out, None)
                old = rollouts.old_logp[sl, :t]
                if grpo:
                    ref = None if rollouts.ref_logp is None else rollouts.ref_logp[sl, :t]
                    loss = grpo_loss(logp, old, advantages[sl], mb_mask, cfg.clip_eps, ref_logp=ref,
                                     kl_coef=cfg.kl_coef, weights=weights[sl, :t])
                else:
                    loss = k25_loss(logp, old, advantages[sl], mb_mask, cfg.alpha, cfg.beta, cfg.tau,
                                    weights=weights[sl, :t], penalty_on_masked=cfg.penalty_on_masked)
                loss.backward()
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
                    if entropy is not None:
                        totals["entropy"] += float(entropy.sum())
            if cfg.max_grad_norm is not None:
                params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
    finally:
        model.train(was_training)

    updates = cfg.updates_per_batch
    metrics = {
        "loss": totals["loss"] / updates,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "advantage_abs_mean": float(advantages.abs().mean()),
        "zero_advantage_groups": float((r.max(dim=1).values == r.min(dim=1).values).float().mean()),
        "response_length": float(rollouts.lengths.float().mean()),
        "truncated_fraction": float(rollouts.truncated.float().mean()),
        "masked_fraction": totals["masked"] / (num_tokens * updates),
        "log_ratio_abs_mean": totals["log_ratio_abs"] / (num_tokens * updates),
        "entropy": totals["entropy"] / num_tokens,
        "updates": float(updates),
    }
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm if math.isfinite(grad_norm) else float("nan")
    by_task: dict[str, list[float]] = defaultdict(list)
    for sample, value in zip(rollouts.row_samples(), r.reshape(-1).tolist()):
        by_task[str(getattr(sample, "task", "unknown"))].append(value)
    for task, values in sorted(by_task.items()):
        metrics[f"reward/{task}"] = sum(values) / len(values)
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
) -> tuple[dict[str, float], Rollouts]:
    """One RL iteration: `rollout` (settings from `cfg`), rewards (`Rollouts.rewards`, with `cfg.token_budget`),
    `rl_step`. Returns `(metrics, rollouts)`."""
    rollouts = rollout(
        model, processor, samples, k=cfg.k, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, seed=seed, micro_batch_size=cfg.micro_batch_size,
        generation_batch_size=cfg.generation_batch_size, ref_model=ref_model, processor_kwargs=processor_kwargs,
    )
    rewards = rollouts.rewards(reward_fn, token_budget=cfg.token_budget, soft_budget=cfg.soft_budget)
    metrics = rl_step(model, optimizer, rollouts, rewards, cfg)
    return metrics, rollouts


__all__ = [
    "ALGORITHMS",
    "RLConfig",
    "Rollouts",
    "clip_mask",
    "group_advantages",
    "group_token_weights",
    "grpo_loss",
    "k25_loss",
    "policy_logprobs",
    "rl_iteration",
    "rl_step",
    "rollout",
    "sequence_token_weights",
    "token_logprobs",
]
