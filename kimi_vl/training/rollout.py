"""Rollouts: K sampled responses per RL prompt with the hybrid cache, and the token log-probs an update needs.

`rollout` encodes each prompt (`kimi_vl.data.encode.encode_prompt`: chat template, images and videos through the
processor), samples `k` responses per prompt with `model.generate` and `SeededSampling` (each row's response a pure
function of its seed: the same in any batch, generation batch or data-parallel rank), then records the
**old-policy** token log-probs with the same model in eval mode (`Rollouts.old_logp`, one forward per micro-batch,
the micro-batches the update uses, so the first update's ratio `pi_theta / pi_old` is exactly 1 on deterministic
kernels).

Log-probs are those of the sampling distribution `softmax(logits / temperature)` (top-k is off; with `top_p < 1`
the nucleus truncation is not reflected in the recorded log-probs, as in TRL).

Shapes: N = P * K sequences, the K responses of prompt p in rows `p*K .. p*K + K-1`; T = longest response.
`response_mask [N, T]` is 1 on generated tokens up to and including the first end token (`<|im_end|>` or `[EOS]`),
0 after it; a response without an end token within `max_new_tokens` is kept whole (`Rollouts.truncated`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessor, TopPLogitsWarper

from ..data.encode import MEDIA_KEYS, encode_prompt, end_token_ids, left_pad, tokenizer_of
from ..errors import ConfigError, ShapeError
from ..tokenization.special_tokens import MEDIA_PAD, VIDEO_PLACEHOLDER
from ..vision.media import short_source
from . import rewards as _rewards


def _accepts_media(model: nn.Module) -> bool:
    model = getattr(model, "module", model)  # a DistributedDataParallel wrapper's forward takes *args, **kwargs
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


def _reward_value(value: Any, row: int, group_size: int) -> float:
    """A reward function's result for response `row` as a float; `ConfigError` unless it is a finite real number."""
    try:
        number = None if isinstance(value, (str, bytes)) else float(value)
    except (TypeError, ValueError, RuntimeError):  # None, a list, a tensor of several values
        number = None
    if number is None or not math.isfinite(number):
        raise ConfigError(f"the reward function returned {short_source(repr(value))} for response {row % group_size} "
                          f"of prompt {row // group_size}; return one finite number per response "
                          "(reward_fn(sample, text, num_tokens=...) -> float).")
    return number


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
        `kimi_vl.training.rewards.reward`), through `kimi_vl.training.rewards.token_budget` when `token_budget` is
        set (for a `reward_fn` of your own too). A `reward_fn` must return a finite real number (a float, int, bool
        or one-element tensor): anything else (None, NaN, a string, a list) raises `ConfigError` naming the row."""
        lengths = self.lengths.tolist()
        values = []
        for n, (sample, text) in enumerate(zip(self.row_samples(), self.texts)):
            if reward_fn is None:
                kw = {} if token_budget is None else {"max_tokens": token_budget, "num_tokens": lengths[n]}
                values.append(_rewards.reward(sample, text, soft_budget=soft_budget, **kw))
            else:
                value = _reward_value(reward_fn(sample, text, num_tokens=lengths[n]), n, self.group_size)
                if token_budget is not None:
                    value = _rewards.token_budget(value, lengths[n], token_budget, soft=soft_budget)
                values.append(value)
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


_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): a well-mixed 64-bit hash of each element."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def row_seeds(seed: int, prompt_indices: Sequence[int], k: int) -> torch.Tensor:
    """`[P * k]` int64 seeds of the rows of a rollout: response `j` of prompt `prompt_indices[p]` (a global index, the
    same whatever process or generation batch the prompt lands in) gets a hash of `(seed, index, j)`."""
    idx = torch.tensor([(int(i) << 20) + j for i in prompt_indices for j in range(k)], dtype=torch.int64)
    return _splitmix(_splitmix(torch.full_like(idx, _signed(int(seed)))) ^ idx)


class SeededSampling(LogitsProcessor):
    """Sampling that is a pure function of each row's seed: with `generate(do_sample=False)`, the chosen token is
    `argmax(log_softmax(logits / T) [nucleus-filtered] + Gumbel noise)` (the Gumbel-max trick: a sample of
    `softmax(logits / T)` restricted to the nucleus), where the noise of row `n`, generated token `t` and vocabulary
    entry `v` is a hash of `(row_seeds[n], t, v)`. A row's response therefore does not depend on the rows it is
    generated with (batch size, generation batches, data-parallel ranks).

    Args:
        seeds: `[N]` int64 per-row seeds (`row_seeds`).
        prompt_width: width of the (left-padded) prompts; `t = input_ids.shape[1] - prompt_width`.
        temperature, top_p: the sampling distribution.
    """

    def __init__(self, seeds: torch.Tensor, prompt_width: int, temperature: float = 1.0, top_p: float = 1.0):
        self.seeds, self.width, self.temperature = seeds, int(prompt_width), float(temperature)
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature
        if self.top_p is not None:
            logits = self.top_p(input_ids, logits)
        t = input_ids.shape[1] - self.width
        seeds = self.seeds.to(scores.device)
        keys = _splitmix(seeds * 1_000_003 + t)[:, None] ^ torch.arange(scores.shape[-1], device=scores.device)
        u = (_shift_right(_splitmix(keys), 11).double() + 0.5) / float(1 << 53)
        return logits - torch.log(-torch.log(u)).to(logits.dtype)


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
    prompt_indices: Sequence[int] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    synced_gpus: bool = False,
) -> Rollouts:
    """Sample `k` responses per sample with `model.generate` (hybrid cache) and record the old-policy log-probs.

    Prompts are built with `encode_prompt` (chat template; images and videos through the processor) and left-padded
    per generation batch (`generation_batch_size` sequences, rounded down to whole groups; default all). Sampling is
    `softmax(logits / temperature)` (top-k off, nucleus `top_p`) through `SeededSampling`: the response `j` of the
    prompt with global index `prompt_indices[p]` (default `p`) is a pure function of `(seed, that index, j)` and the
    model, whatever batch or process it is generated in (`seed=None`: a seed drawn from torch's global RNG).
    Generation stops at `<|im_end|>` or `[EOS]`. Right after sampling, the same model in eval mode computes
    `old_logp` (`policy_logprobs`, micro-batches of `micro_batch_size` rows); `ref_model`, when given, gives
    `ref_logp` the same way. Generation and log-probs run under `autocast()` (the trainer's mixed precision);
    `synced_gpus` keeps every data-parallel rank stepping until all are done (FSDP). The model's train/eval mode is
    restored on return.
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
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    indices = range(len(samples)) if prompt_indices is None else list(prompt_indices)
    if len(indices) != len(samples):
        raise ConfigError(f"{len(indices)} prompt indices for {len(samples)} samples; give one per sample.")
    seeds = row_seeds(seed, indices, k)

    was_training = model.training
    model.eval()
    responses: list[torch.Tensor] = []
    try:
        with autocast():
            for start in range(0, len(samples), per_call):
                group = encoded[start : start + per_call]
                batch = left_pad([row for row in group for _ in range(k)], pad, device)
                width = batch["input_ids"].shape[1]
                sampler = SeededSampling(seeds[start * k: (start + len(group)) * k], width, temperature, top_p)
                out = model.generate(
                    **batch, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=ends,
                    use_cache=True, suppress_tokens=list(suppress) or None, logits_processor=[sampler],
                    synced_gpus=synced_gpus,
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
    with autocast():
        result.old_logp = policy_logprobs(model, result)
        if ref_model is not None:
            result.ref_logp = policy_logprobs(ref_model, result)
    return result


__all__ = ["Rollouts", "SeededSampling", "policy_logprobs", "rollout", "row_seeds", "token_logprobs"]
