"""MuonClip: Muon for hidden matrices, AdamW for the rest, and QK-Clip on the MLA heads after every step.

Muon (Moonlight / Kimi K2 recipe, the same arithmetic as `torch.optim.Muon` with
`adjust_lr_fn="match_rms_adamw"`):

    m = mu * m + (1 - mu) * g                (EMA momentum, torch's convention)
    u = (1 - mu) * g + mu * m   (nesterov)   or   u = m
    O = NS5(u)                               (Newton-Schulz, fp32 for fp32 params, bf16 otherwise)
    W = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

The EMA momentum is `(1 - mu)` times Moonlight's summed momentum; NS normalises its input, so the updates are the
same (up to NS's eps). Stacked expert weights `[E, out, in]` are orthogonalised per expert (batched NS, each
`[out, in]` slice its own matrix, lr scaled by its own `max(out, in)`).

Routing (`MuonClip.routing()` lists it):
- AdamW: parameters tagged `_kimi_optim == "adamw"` (AttnRes), `nn.Embedding` weights (`embed_tokens`), the output
  embedding (`lm_head`; a tied one is the embedding itself and is routed once), every norm (modules whose class name
  contains "Norm"), biases, conv weights, every parameter with `ndim < 2` or `ndim > 2` other than stacked expert
  weights (KDA's `A_log`, `dt_bias`, MoonViT's position table).
- Muon: every other 2-D matrix, including the MoE router `gate.weight` `[E, hidden]` (Moonlight's rule: every
  hidden matrix except embeddings and the head goes to Muon; the router is a hidden linear map, not a gain), and each
  expert slice of `Experts.w1/w2/w3`.

QK-Clip (Kimi K2): the optimizer switches on `record_max_logits` of every `MultiHeadLatentAttention`; after the
update, for each such module with a recorded per-head max logit `S_h` (since the previous step) and `S_h > tau`, it
sets `gamma_h = tau / S_h` and scales head h's q_nope rows and k_nope rows (in `kv_b_proj`) by `sqrt(gamma_h)`
and its q_pe rows by `gamma_h` (`q_proj`, or `q_b_proj` with a low-rank query). The shared rotary key in
`kv_a_proj_with_mqa`, the values, `o_proj` and the down-projections are never touched, so every logit of head h
is scaled by exactly `gamma_h` and other heads are unchanged. Recorded maxima are reset after every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..text.attnres import ADAMW_TAG
from ..text.mla import MultiHeadLatentAttention
from ..text.moe import Experts

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as in torch.optim.Muon
NS_EPS = 1e-7


def zeropower_via_newtonschulz(g: torch.Tensor, steps: int = 5, eps: float = NS_EPS,
                               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate `U V^T` of `g [..., A, B]` (each trailing matrix on its own) by `steps` quintic Newton-Schulz
    iterations, computed in `dtype` (default: fp32 for fp32/fp64 inputs, bf16 otherwise). Never writes to `g`."""
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(g.shape)}")
    if dtype is None:
        dtype = torch.float32 if g.dtype in (torch.float32, torch.float64) else torch.bfloat16
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # out of place: g (or a bf16 alias) stays intact
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def route_parameters(model: nn.Module) -> dict[str, str]:
    """`name -> "muon" | "adamw"` for every trainable parameter of `model` (shared parameters once)."""
    owner: dict[str, nn.Module] = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            owner[f"{mod_name}.{p_name}" if mod_name else p_name] = module
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_ids = {id(p) for p in out_emb.parameters()} if isinstance(out_emb, nn.Module) else set()
    routes: dict[str, str] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module = owner.get(name)
        leaf = name.rsplit(".", 1)[-1]
        adamw = (
            getattr(p, ADAMW_TAG, None) == "adamw"
            or isinstance(module, nn.Embedding)
            or id(p) in out_ids
            or "embed_tokens" in name
            or "lm_head" in name
            or (module is not None and _is_norm(module))
            or isinstance(module, nn.modules.conv._ConvNd)
            or leaf == "bias"
            or p.ndim < 2
        )
        if adamw:
            routes[name] = "adamw"
        elif p.ndim == 2 or (p.ndim == 3 and isinstance(module, Experts)):
            routes[name] = "muon"
        else:
            routes[name] = "adamw"
    return routes


class MuonClip(torch.optim.Optimizer):
    """Muon + AdamW (routed by `route_parameters`) + QK-Clip on MLA heads. See the module docstring.

    `param_groups` hold a `kind` field ("muon" / "adamw"); `routing()` maps parameter names to kinds;
    `last_max_logits` maps each MLA module name to its per-head max logit (before clipping) of the last step.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        *,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        qk_clip_tau: float | None = 100.0,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"bad hyper-parameters: lr={lr}, weight_decay={weight_decay}, momentum={momentum}")
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 99], got {ns_steps}")
        if qk_clip_tau is not None and qk_clip_tau <= 0:
            raise ValueError(f"qk_clip_tau must be positive (or None to disable QK-Clip), got {qk_clip_tau}")
        self._routing = route_parameters(model)
        named = dict(model.named_parameters())
        groups = []
        for kind in ("muon", "adamw"):
            names = [n for n, k in self._routing.items() if k == kind]
            if names:
                groups.append({"params": [named[n] for n in names], "kind": kind})
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=adamw_betas, eps=adamw_eps)
        super().__init__(groups, defaults)
        self.qk_clip_tau = qk_clip_tau
        self.attention_modules: dict[str, MultiHeadLatentAttention] = {}
        if qk_clip_tau is not None:
            for name, module in model.named_modules():
                if isinstance(module, MultiHeadLatentAttention):
                    module.record_max_logits = True
                    module.max_logits = None
                    self.attention_modules[name] = module
        self.last_max_logits: dict[str, torch.Tensor] = {}

    def routing(self) -> dict[str, str]:
        """Parameter name -> "muon" | "adamw"."""
        return dict(self._routing)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        if self.qk_clip_tau is not None:
            self.qk_clip()
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError("MuonClip supports neither sparse gradients nor complex parameters")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            update = zeropower_via_newtonschulz(update, group["ns_steps"])
            A, B = p.shape[-2:]
            p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(A, B)))

    def _adamw_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MuonClip's AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = state["step"].item()
            grad = p.grad
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias1, bias2 = 1 - beta1**t, 1 - beta2**t
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(eps)
            p.mul_(1 - lr * wd)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)

    @torch.no_grad()
    def qk_clip(self) -> None:
        """Apply QK-Clip from the max logits recorded since the last call, then reset them (called by `step`)."""
        tau = self.qk_clip_tau
        self.last_max_logits = {}
        for name, module in self.attention_modules.items():
            s = module.max_logits
            module.max_logits = None
            if s is None:
                continue
            self.last_max_logits[name] = s.clone()
            if tau is None or not bool((s > tau).any()):
                continue
            gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
            clip_mla_heads(module, gamma)


@torch.no_grad()
def clip_mla_heads(module: MultiHeadLatentAttention, gamma: torch.Tensor) -> None:
    """Scale head h's logits by `gamma[h]`: q_nope and k_nope rows by sqrt(gamma), q_pe rows by gamma."""
    h, nope, rope, v = module.num_heads, module.nope_dim, module.rope_dim, module.v_dim
    q_proj = module.q_proj if module.q_lora_rank is None else module.q_b_proj
    wq = q_proj.weight.view(h, nope + rope, -1)
    g = gamma.to(device=wq.device, dtype=torch.float32)
    root = g.sqrt()
    wq[:, :nope].copy_((wq[:, :nope].float() * root[:, None, None]).to(wq.dtype))
    wq[:, nope:].copy_((wq[:, nope:].float() * g[:, None, None]).to(wq.dtype))
    wkv = module.kv_b_proj.weight.view(h, nope + v, -1)
    wkv[:, :nope].copy_((wkv[:, :nope].float() * root[:, None, None]).to(wkv.dtype))
