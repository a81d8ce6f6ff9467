"""MuonClip: Muon for hidden matrices, AdamW for the rest, and QK-Clip on the attention heads after every step.

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

QK-Clip (Kimi K2): the optimizer switches on `record_max_logits` of every `MultiHeadLatentAttention` and, with
`qk_clip_vision=True` (default), every `MoonViTAttention`; each forward folds its per-head max pre-softmax logit
(scale included, masked pairs and cross-segment pairs never count) into the module's `max_logits`, so the maxima
accumulate over every forward since the previous step (gradient-accumulation micro-batches). After the update,
`qk_clip()` gathers all modules' maxima into one flat vector, all-reduces it with MAX when torch.distributed is
initialised (one collective for the whole model, so every rank computes the same gamma and clips identically; a
module that did not run on some rank contributes -inf there), and for each head with `S_h > tau` sets
`gamma_h = tau / S_h`:
- MLA: head h's q_nope rows and k_nope rows (in `kv_b_proj`) are scaled by `sqrt(gamma_h)` and its q_pe rows by
  `gamma_h` (`q_proj`, or `q_b_proj` with a low-rank query). The shared rotary key in `kv_a_proj_with_mqa`, the
  values, `o_proj` and the down-projections are never touched, so every logit of head h is scaled by exactly
  `gamma_h` and other heads are unchanged.
- MHA (MoonViT's fused `qkv`): head h's query rows and key rows of the weight AND the matching bias entries are
  scaled by `sqrt(gamma_h)`. The bias is part of the affine map `q = W_q x + b_q`: scaling only the weight would
  leave `b_q . k` terms unscaled, so the clipped logit would miss tau and the clip would depend on the input; with
  the bias scaled too, `q_h` and `k_h` (and their 2-D rotary images, a linear map per token) scale by exactly
  `sqrt(gamma_h)`, so every logit of head h scales by `gamma_h`. Value rows are never touched.
Recorded maxima are reset after every step (`reset_max_logits()` discards them by hand, e.g. after evaluation
forwards between steps, which are recorded too).

Distributed: parameters that are DTensors (FSDP2 `fully_shard`, sharded on dim 0) get the same update as on one
process: the momentum buffer stays sharded like the parameter (element-wise, local), the Nesterov update is
gathered (`full_tensor()`), Newton-Schulz runs on the full matrix (per expert for stacked experts; every rank
computes it, Moonlight's simplest correct Distributed Muon), and each rank keeps only its own shard of the result.
AdamW is element-wise and runs on the local shards. Under DDP gradients are already averaged and every rank runs
the identical update, so nothing special is needed. QK-Clip scales the local rows of sharded weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..text.attnres import ADAMW_TAG
from ..text.mla import MultiHeadLatentAttention
from ..text.moe import Experts
from ..vision.moonvit import MoonViTAttention
from .distributed import all_reduce_max, scale_rows_, shard_like

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
    """Muon + AdamW (routed by `route_parameters`) + QK-Clip on MLA and MoonViT heads. See the module docstring.

    Args:
        model: the model to train; parameters are routed and attention modules found from it. Under FSDP2 build
            the optimizer after `fully_shard`, so that it holds the DTensor parameters; under DDP from the bare
            module or the wrapper (same parameters).
        lr, weight_decay: shared by both groups (Muon's lr is RMS-matched to AdamW's).
        momentum, nesterov, ns_steps: Muon's settings (`torch.optim.Muon`'s meaning).
        adamw_betas, adamw_eps: AdamW's settings.
        qk_clip_tau: the max-logit threshold; None disables QK-Clip (and max-logit recording).
        qk_clip_vision: also record and clip the vision encoder's attention heads.

    `param_groups` hold a `kind` field ("muon" / "adamw"); `routing()` maps parameter names to kinds;
    `attention_modules` maps module names to the clipped attention modules; `last_max_logits` maps each of them to
    its per-head max logit `[num_heads]` (fp32, on the CPU; before clipping, over micro-batches and ranks) of the
    last step; modules that ran in no forward since the previous step are absent.
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
        qk_clip_vision: bool = True,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ConfigError(f"MuonClip needs lr >= 0, weight_decay >= 0 and 0 <= momentum < 1; got lr={lr}, "
                              f"weight_decay={weight_decay}, momentum={momentum}.")
        if not 0 < ns_steps < 100:
            raise ConfigError(f"ns_steps must be in [1, 99], got {ns_steps}.")
        if qk_clip_tau is not None and not qk_clip_tau > 0:
            raise ConfigError(f"qk_clip_tau must be positive (or None to disable QK-Clip), got {qk_clip_tau}.")
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
        self.qk_clip_vision = qk_clip_vision
        kinds = (MultiHeadLatentAttention, MoonViTAttention) if qk_clip_vision else (MultiHeadLatentAttention,)
        self.attention_modules: dict[str, MultiHeadLatentAttention | MoonViTAttention] = {}
        for name, module in model.named_modules():
            if isinstance(module, (MultiHeadLatentAttention, MoonViTAttention)):
                # The optimizer owns the switch: modules it will not clip stop paying for the recording.
                clipped = qk_clip_tau is not None and isinstance(module, kinds)
                module.record_max_logits = clipped
                module.max_logits = None
                if clipped:
                    self.attention_modules[name] = module
        self.last_max_logits: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer keeps only defaults/state/param_groups; `copy.deepcopy((model, opt))` must also
        # carry the QK-Clip settings and the (copied) attention modules.
        state = super().__getstate__()
        for key in ("_routing", "qk_clip_tau", "qk_clip_vision", "attention_modules", "last_max_logits"):
            state[key] = self.__dict__[key]
        return state

    def routing(self) -> dict[str, str]:
        """Parameter name -> "muon" | "adamw"."""
        return dict(self._routing)

    def reset_max_logits(self) -> None:
        """Discard the max logits recorded since the last step (e.g. by evaluation forwards)."""
        for module in self.attention_modules.values():
            module.max_logits = None

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
            if isinstance(update, DTensor):  # FSDP2 shard: NS needs the whole matrix; keep our shard of the result
                update = shard_like(zeropower_via_newtonschulz(update.full_tensor(), group["ns_steps"]), p)
            else:
                update = zeropower_via_newtonschulz(update, group["ns_steps"])
            A, B = p.shape[-2:]  # the global shape, also for a DTensor
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
        """Apply QK-Clip from the max logits recorded since the last call (all-reduced with MAX over ranks), then
        reset them. Called by `step`; every rank must call it when torch.distributed is initialised."""
        tau = self.qk_clip_tau
        self.last_max_logits = {}
        modules = list(self.attention_modules.items())
        if not modules:
            return
        sizes = [module.num_heads for _, module in modules]
        device = next((m.max_logits.device for _, m in modules if m.max_logits is not None),
                      next(modules[0][1].parameters()).device)
        flat = torch.full((sum(sizes),), float("-inf"), device=device)
        for (_, module), chunk in zip(modules, flat.split(sizes)):
            if module.max_logits is not None:
                chunk.copy_(module.max_logits)
            module.max_logits = None
        flat = all_reduce_max(flat).cpu()
        for (name, module), s in zip(modules, flat.split(sizes)):
            if bool((s == float("-inf")).all()):  # ran in no forward on any rank
                continue
            self.last_max_logits[name] = s.clone()
            if tau is None or not bool((s > tau).any()):
                continue
            gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
            if isinstance(module, MultiHeadLatentAttention):
                clip_mla_heads(module, gamma)
            else:
                clip_mha_heads(module, gamma)


@torch.no_grad()
def clip_mla_heads(module: MultiHeadLatentAttention, gamma: torch.Tensor) -> None:
    """Scale head h's logits by `gamma[h]` (`[num_heads]`): q_nope and k_nope rows by sqrt(gamma), q_pe rows by
    gamma; the shared rotary key, values and down-projections are untouched."""
    h, nope, rope, v = module.num_heads, module.nope_dim, module.rope_dim, module.v_dim
    g = gamma.detach().to(device="cpu", dtype=torch.float32)
    root = g.sqrt()
    q_rows = torch.cat([root[:, None].expand(h, nope), g[:, None].expand(h, rope)], dim=1).reshape(-1)
    scale_rows_(module.q_proj.weight if module.q_lora_rank is None else module.q_b_proj.weight, q_rows)
    kv_rows = torch.cat([root[:, None].expand(h, nope), torch.ones(h, v)], dim=1).reshape(-1)
    scale_rows_(module.kv_b_proj.weight, kv_rows)


@torch.no_grad()
def clip_mha_heads(module: MoonViTAttention, gamma: torch.Tensor) -> None:
    """Scale head h's logits by `gamma[h]` (`[num_heads]`) in a fused `qkv` Linear (`[3 * heads * head_dim, in]`
    rows ordered q, k, v, head-major): the head's query and key rows of the weight and bias by sqrt(gamma);
    value rows untouched."""
    h, d = module.num_heads, module.head_dim
    root = gamma.detach().to(device="cpu", dtype=torch.float32).sqrt()[:, None].expand(h, d).reshape(-1)
    rows = torch.cat([root, root, torch.ones(h * d)])
    scale_rows_(module.qkv.weight, rows)
    if module.qkv.bias is not None:
        scale_rows_(module.qkv.bias, rows)
