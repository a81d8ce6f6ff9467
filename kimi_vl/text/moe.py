"""Feed-forward sublayers: the dense SwiGLU and the sigmoid-routed MoE with shared experts.

Router (DeepSeek-V3 `noaux_tc`, as in Kimi-Linear): `s = sigmoid(x W^T)` in fp32, experts chosen by top-k of
`s + e_score_correction_bias` (group-limited when `n_group > 1`), weights gathered from the **unbiased** `s` by
default (transformers' `kimi_linear`, vLLM, DeepSeek-V3) or from the biased scores when
`config.router_biased_weights` (the released remote code, whose `KimiMoEGate` adds the bias in place to a view of
the scores, so its weights come from `sigmoid + bias`), renormalised and scaled by
`routed_scaling_factor`. The bias is not trained by gradient: `update_router_bias` nudges it from the expert load
(aux-loss-free balancing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.autocast import autocast_off
from ..optim_contract import MUON_BATCHED
from .configuration import KimiTextConfig


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`. Shapes: `[..., hidden] -> [..., hidden]`."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Shapes: `x [N, hidden]` -> `weights [N, k]` (fp32), `indices [N, k]`.

    In training forwards it adds the experts chosen for each token to `expert_load`; `counted [N]` (bool) limits
    that count to the real tokens (padding is routed like any token but must not steer the balancing: ranks pad
    differently, so counting it would make the bias update depend on how the batch is split). Under activation
    checkpointing the backward pass recomputes the forward and counts each token again: every count doubles, which
    leaves what uses them unchanged (the bias moves by the sign of mean load - load; the metric is max / mean)."""

    def __init__(self, config: KimiTextConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.biased_weights = config.router_biased_weights
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # Both fp32 whatever the model's dtype (`FP32_BUFFERS`): in bf16 a bias near 0.5 absorbs `rate=1e-3` whole and
        # a count past 256 stops counting single tokens.
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # Tokens routed to each expert since the last `update_router_bias` (training only; not saved).
        self.register_buffer("expert_load", torch.zeros(config.num_experts, dtype=torch.float32), persistent=False)

    FP32_BUFFERS = ("e_score_correction_bias", "expert_load")

    def _apply(self, fn, recurse=True):
        """`.to(dtype)`, `.half()` and `.bfloat16()` cast the weight but never take `FP32_BUFFERS` below fp32 (they
        still move with the device), as `from_pretrained(dtype=...)` keeps them (`_keep_in_fp32_modules_strict`)."""
        kept = {name: getattr(self, name) for name in self.FP32_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, name)
            if new.is_floating_point() and torch.finfo(new.dtype).bits < 32 <= torch.finfo(old.dtype).bits:
                self._buffers[name] = old.to(device=new.device)
        return self

    def forward(self, x: torch.Tensor, counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast_off(x):  # fp32 scores in bf16 mixed precision too: bf16 logits change the chosen experts
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        choice = biased
        if self.n_group > 1:
            grouped = biased.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(biased)
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = (biased if self.biased_weights else scores).gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.training:
            chosen = indices if counted is None else indices[counted]
            self.expert_load += torch.bincount(chosen.flatten(), minlength=self.num_experts).to(self.expert_load)
        return weights * self.scaling, indices

    @torch.no_grad()
    def update_router_bias(self, rate: float = 1e-3) -> torch.Tensor:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones, by `rate`
        times the sign of (mean load - load). Resets the load counter; returns the load it used."""
        load = self.expert_load.clone()
        if load.sum() > 0:
            self.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()
        return load


class Experts(nn.Module):
    """`E` SwiGLU experts stored stacked: `w1` (gate) and `w3` (up) `[E, I, hidden]`, `w2` (down) `[E, hidden, I]`.

    Computed batched: the (token, slot) pairs are sorted by expert and each expert runs one matmul over all its
    tokens (a loop over experts, never over tokens). For the optimizer each stacked weight is `MUON_BATCHED`: every
    expert's `[out, in]` slice is its own Muon matrix.
    """

    optimizer_routes = {"w1": MUON_BATCHED, "w2": MUON_BATCHED, "w3": MUON_BATCHED}

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x `[N, hidden]`, weights/indices `[N, k]` -> `[N, hidden]` = sum_k w_k Expert_{i_k}(x)."""
        N, k = indices.shape
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()
        xs = x.index_select(0, token)  # backward: an index_add, cheaper than indexing's accumulating scatter
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                xe = xs[start : start + n]
                outs.append(F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e]))
            start += n
        y = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)
        # Back to (token, slot) order and summed over the k slots: a gather and a sum, which stay on the calling
        # thread for decode-sized inputs (an `index_add_` opens a parallel region however small its input, and
        # such regions stall for milliseconds when other processes hold the cores). The gather's index is the
        # inverse of `order`, scattered in O(N k) rather than sorted again.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return y.index_select(0, inverse).view(N, k, -1).sum(1)


class MoE(nn.Module):
    """Routed experts plus shared experts. Shapes: `[B, T, hidden] -> [B, T, hidden]`; `token_mask [B, T]` (bool,
    optional): the real tokens, the only ones the router counts in its expert load."""

    def __init__(self, config: KimiTextConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (
            SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat, None if token_mask is None else token_mask.reshape(-1))
        y = self.experts(flat, weights, indices).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
