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

Routing (`MuonClip.routing()` lists it) follows the modules' declarations (`kimi_vl.optim_contract`): a module's
`optimizer_routes` labels its parameters `MUON` (a 2-D matrix), `MUON_BATCHED` (a stack of matrices, each its own
Muon matrix: `Experts.w1/w2/w3`) or `ADAMW` (AttnRes queries and gains); undeclared parameters go to AdamW when
they are embeddings (`nn.Embedding`, output embeddings from `get_output_embeddings()`; a tied one is routed once) or
not 2-D matrices (norm gains, biases, conv filters, KDA's `A_log` and `dt_bias`, MoonViT's position table), and to
Muon otherwise, including the MoE router `gate.weight` `[E, hidden]` (Moonlight's rule: every hidden matrix except
embeddings and the head goes to Muon; the router is a hidden linear map, not a gain). The optimizer knows no model
class: a new parameter kind declares its route.

QK-Clip (Kimi K2) acts on every `QKClipTarget` module (`kimi_vl.optim_contract`; MLA and MoonViT attention, the
latter only with `qk_clip_vision=True`, the default); the query/key weights of a frozen one (`requires_grad=False`
at construction and not added with `add_param_group`, e.g. a frozen vision tower) are left alone, like every
parameter the optimizer does not hold (its max logits are still reported), and an attention with only some of them
trained is refused (`ConfigError`). The optimizer switches on their `record_max_logits`; each forward folds its
per-head max pre-softmax logit (scale included, masked pairs and cross-segment pairs never count) into the module's
`max_logits`, so the maxima accumulate over every forward since the previous step (gradient-accumulation
micro-batches). After the update, `qk_clip()` gathers all targets' maxima into one flat vector, all-reduces it with
MAX when torch.distributed is initialised (one collective for the whole model, so every rank computes the same gamma
and clips identically; a module that did not run on some rank contributes -inf there), and for each head with
`S_h > tau` sets `gamma_h = tau / S_h`; the module's `qk_clip_row_scales(gamma)` names the query/key rows to scale,
and the optimizer scales them (`scale_rows_`, sharded weights included):
- MLA: head h's q_nope and k_nope rows by `sqrt(gamma_h)`, its q_pe rows by `gamma_h`; the shared rotary key,
  values, `o_proj` and the down-projections untouched, so every logit of head h scales by exactly `gamma_h`.
- MHA (MoonViT's fused `qkv`): head h's query and key rows of the weight and the bias by `sqrt(gamma_h)`.
Recorded maxima are reset after every step. Between steps, `reset_max_logits()` discards forwards that were not
training (evaluation, which is recorded too) and `discard_step()` voids a skipped step (a non-finite loss or
gradient): its maxima are dropped and `last_max_logits` reports nothing for it.

Distributed: parameters that are DTensors (FSDP2 `fully_shard`, sharded on dim 0) get the same update as on one
process: the momentum buffer stays sharded like the parameter (element-wise, local), the Nesterov update is
gathered (`full_tensor()`), Newton-Schulz runs on the full matrix (per expert for stacked experts; every rank
computes it, Moonlight's simplest correct Distributed Muon), and each rank keeps only its own shard of the result.
AdamW is element-wise and runs on the local shards. Under DDP gradients are already averaged and every rank runs
the identical update, so nothing special is needed. QK-Clip scales the local rows of sharded weights.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..optim_contract import ADAMW, QKClipTarget, parameter_routes
from .distributed import all_reduce_max, scale_rows_, shard_like

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as in torch.optim.Muon
NS_EPS = 1e-7
NS_BATCH_ELEMENTS = 1 << 22  # most elements of same-shape updates orthogonalised in one batch (16 MiB in fp32)


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


def route_parameters(model: nn.Module) -> dict[str, str]:
    """`name -> "muon" | "adamw"` for every trainable parameter of `model` (shared parameters once), from
    `kimi_vl.optim_contract.parameter_routes` (`MUON` and `MUON_BATCHED` both run Muon: Newton-Schulz and the lr
    scale act on the trailing `[out, in]` matrices)."""
    return {name: "adamw" if label == ADAMW else "muon" for name, label in parameter_routes(model).items()}


class MuonClip(torch.optim.Optimizer):
    """Muon + AdamW (routed by `route_parameters`) + QK-Clip on every `QKClipTarget`. See the module docstring.

    Args:
        model: the model to train; parameters are routed and attention modules found from it. Under FSDP2 build
            the optimizer after `fully_shard`, so that it holds the DTensor parameters; under DDP from the bare
            module or the wrapper (same parameters).
        lr, weight_decay: shared by both groups (Muon's lr is RMS-matched to AdamW's).
        momentum, nesterov, ns_steps: Muon's settings (`torch.optim.Muon`'s meaning).
        adamw_betas, adamw_eps: AdamW's settings.
        qk_clip_tau: the max-logit threshold; None disables QK-Clip (and max-logit recording).
        qk_clip_vision: also record and clip the heads of targets in group "vision" (the vision encoder).

    `param_groups` hold a `kind` field ("muon" / "adamw"; `add_param_group` needs it); `routing()` maps the
    constructor's parameter names to kinds; `attention_modules` maps module names to the recorded `QKClipTarget`s
    (clipped unless their query/key weights are frozen); `last_max_logits` maps each of them to its per-head max
    logit `[num_heads]` (fp32, on the CPU; before clipping, over micro-batches and ranks) of the last step; modules
    that ran in no forward since the previous step are absent.

    Updates are applied in each parameter's own dtype and no fp32 master copy is kept (as in `torch.optim`): train
    fp32 weights under bf16 autocast (the trainer's `--precision bf16`); on a model cast to bf16 an update below
    half a bf16 ulp of its weight is lost (at lr 1e-4 most of them).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float = 0.1,
        *,
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
        if not isinstance(model, nn.Module):
            raise ConfigError(f"MuonClip takes the model (an nn.Module), got {type(model).__name__}: it routes the "
                              f"parameters by the modules that own them and finds the attention modules QK-Clip "
                              f"acts on, so pass MuonClip(model, lr), not model.parameters().")
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
        self.attention_modules: dict[str, QKClipTarget] = {}
        for name, module in model.named_modules():
            if isinstance(module, QKClipTarget):
                # The optimizer owns the switch: modules it will not clip stop paying for the recording.
                clipped = qk_clip_tau is not None and (qk_clip_vision or module.qk_clip_group != "vision")
                module.record_max_logits = clipped
                module.max_logits = None
                if clipped:
                    self.attention_modules[name] = module
        held = self._held_ids()
        for name, module in self.attention_modules.items():  # a partly frozen attention is refused now, not mid-run
            self._holds_query_key(name, module.qk_clip_row_scales(torch.ones(module.num_heads)), held)
        self.last_max_logits: dict[str, torch.Tensor] = {}

    def _held_ids(self) -> set[int]:
        """The ids of the parameters this optimizer holds (every group, `add_param_group`'s included)."""
        return {id(p) for group in self.param_groups for p in group["params"]}

    @staticmethod
    def _holds_query_key(name: str, row_scales: list[tuple[torch.Tensor, torch.Tensor]], held: set[int]) -> bool:
        """Whether this optimizer holds (`held`: the ids of its parameters) every parameter of `row_scales`, what
        module `name`'s `qk_clip_row_scales` returned: True if all, False if none (a frozen attention, which QK-Clip
        leaves alone: an optimizer changes no parameter it does not hold; `add_param_group` may add them later).

        Raises:
            ConfigError: it holds only some; scaling those alone would not scale the head's logits by gamma.
        """
        holds = [id(p) in held for p, _ in row_scales]
        if all(holds):
            return True
        if not any(holds):
            return False
        raise ConfigError(f"QK-Clip scales the query and key weights of {name or 'the model'} together, but the "
                          f"optimizer trains only {sum(holds)} of its {len(holds)}: make all of them trainable (or "
                          f"add them all with add_param_group) or freeze all of them (QK-Clip then leaves that "
                          f"attention alone), or build MuonClip with qk_clip_tau=None (qk_clip_vision=False for a "
                          f"vision attention).")

    def add_param_group(self, param_group: dict) -> None:
        """`torch.optim.Optimizer.add_param_group` (e.g. for adapters added after construction): the group names its
        update rule, `kind="muon"` (matrices `[..., out, in]`, each trailing matrix its own Muon matrix) or
        `kind="adamw"`; its other settings default to the constructor's.

        Raises:
            ConfigError: no or an unknown `kind`, or a `"muon"` parameter that is not a matrix.
        """
        kind = param_group.get("kind")
        if kind not in ("muon", "adamw"):
            raise ConfigError(f"a MuonClip parameter group needs kind='muon' (hidden matrices) or kind='adamw' "
                              f"(embeddings, heads, gains, biases), got kind={kind!r}; e.g. "
                              f"opt.add_param_group({{'params': params, 'kind': 'muon'}}).")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)  # may be a one-shot iterator
        if kind == "muon":
            shapes = [tuple(p.shape) for p in (q[1] if isinstance(q, tuple) else q for q in params) if p.ndim < 2]
            if shapes:
                raise ConfigError(f"kind='muon' takes matrices [..., out, in], got parameters of shapes {shapes}; "
                                  f"put them in a kind='adamw' group.")
        super().add_param_group({**param_group, "params": params})

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
        """Discard the max logits recorded since the last step (e.g. by evaluation forwards), so that the next
        QK-Clip sees only the next step's training forwards."""
        for module in self.attention_modules.values():
            module.max_logits = None

    def discard_step(self) -> None:
        """Void the current step instead of calling `step()` (e.g. its loss or gradient is not finite): the max
        logits its forwards recorded are dropped and `last_max_logits` becomes empty (nothing to report for it).
        Parameters and optimizer state are untouched; gradients are the caller's (`zero_grad`)."""
        self.reset_max_logits()
        self.last_max_logits = {}

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
        same_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
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
                orth = shard_like(zeropower_via_newtonschulz(update.full_tensor(), group["ns_steps"]), p)
                self._apply_muon(p, orth, lr, wd)
            else:
                same_shape[(update.shape, update.dtype, update.device)].append((p, update))
        # Matrices of one shape, dtype and device share a batched Newton-Schulz (each still its own matrix: the same
        # values) in batches of at most NS_BATCH_ELEMENTS elements: fewer, larger kernel calls for small models (21
        # instead of 65 for the tiny preset), one matrix at a time, as before, for large ones (no stacked copy).
        for pairs in same_shape.values():
            per_batch = max(1, NS_BATCH_ELEMENTS // pairs[0][1].numel())
            for start in range(0, len(pairs), per_batch):
                batch = pairs[start:start + per_batch]
                orth = zeropower_via_newtonschulz(torch.stack([u for _, u in batch]), group["ns_steps"])
                for (p, _), o in zip(batch, orth.unbind(0), strict=True):
                    self._apply_muon(p, o, lr, wd)

    @staticmethod
    def _apply_muon(p: torch.Tensor, orth: torch.Tensor, lr: float, wd: float) -> None:
        A, B = p.shape[-2:]  # the global shape, also for a DTensor
        p.mul_(1 - lr * wd)
        p.add_(orth.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(A, B)))

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
        held = None  # ids of the parameters this optimizer holds, once a head needs clipping
        for (name, module), s in zip(modules, flat.split(sizes)):
            if bool((s == float("-inf")).all()):  # ran in no forward on any rank
                continue
            self.last_max_logits[name] = s.clone()
            if tau is None or not bool((s > tau).any()):
                continue
            gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
            row_scales = module.qk_clip_row_scales(gamma)
            if held is None:
                held = self._held_ids()
            if self._holds_query_key(name, row_scales, held):
                for param, rows in row_scales:
                    scale_rows_(param, rows)

