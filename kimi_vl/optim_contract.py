"""What model modules tell the optimizer: how their parameters are routed, and how their attention takes part in
QK-Clip. `kimi_vl.training.MuonClip` reads only this contract; it never imports a model class.

This module sits beside `kimi_vl.kernels` at the bottom of the dependency order (it imports only torch and
`kimi_vl.errors`), so `kimi_vl.text`, `kimi_vl.vision` and user models can implement it without importing
`kimi_vl.training`.

Parameter routes. A module declares the update rule of its parameters in a class (or instance) attribute

    optimizer_routes = {"w1": MUON_BATCHED, "queries": ADAMW, ...}

keyed by names relative to the module: a key names one parameter (`"w1"`) or a submodule whose parameters all take
the route (`"queries"`, an `nn.ParameterList`). The most specific declaration wins (the longest matching name, so
a submodule's own declaration overrides its parent's). Labels:
- `MUON`: one hidden matrix `[out, in]`, orthogonalised as a whole;
- `MUON_BATCHED`: a stack `[..., out, in]` of independent matrices (stacked experts `[E, out, in]`), each trailing
  matrix orthogonalised on its own with its own RMS-matching lr scale;
- `ADAMW`: element-wise AdamW.
An undeclared parameter takes the default: AdamW for `nn.Embedding` weights, for output embeddings (what any
submodule's `get_output_embeddings()` returns; a tied one is the input embedding) and for every parameter that is
not a 2-D matrix (norm gains, biases, conv filters, position tables, gate scalars); Muon for every other 2-D
matrix. Declarations live on modules, not on the parameter tensors, because FSDP2's `fully_shard`,
`copy.deepcopy` and Hugging Face's weight loading all replace parameter objects and drop attributes set on them.

QK-Clip targets. An attention module takes part in QK-Clip by satisfying `QKClipTarget` (structurally: no base
class needed; `MaxLogitRecorder` supplies the recording half). To make a new attention module clip-able:
1. give it `num_heads` and `qk_clip_group` ("text" or "vision");
2. when `record_max_logits` is True, fold each forward's per-head max pre-softmax logit (scale included, over the
   pairs it attends only; `kimi_vl.kernels.max_logits` / `packed_max_logits` compute it blockwise) into
   `max_logits` with `MaxLogitRecorder.fold_max_logits`;
3. implement `qk_clip_row_scales(gamma)`: the rows of its query/key parameters to scale so that every logit of
   head `h` is multiplied by `gamma[h]` and no other head's logits change.
The optimizer switches `record_max_logits` on, reads and resets `max_logits`, all-reduces the maxima over ranks,
computes gamma and scales the rows it is given (sharded parameters included).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .errors import ConfigError

MUON = "muon"
MUON_BATCHED = "muon_batched"
ADAMW = "adamw"
ROUTE_LABELS = (MUON, MUON_BATCHED, ADAMW)


def parameter_routes(model: nn.Module) -> dict[str, str]:
    """`name -> MUON | MUON_BATCHED | ADAMW` for every trainable parameter of `model` (shared parameters once, under
    their first name), from the modules' `optimizer_routes` declarations and the default (module docstring).

    Raises:
        ConfigError: an unknown label, or a label that does not fit the parameter's shape (`MUON` on anything but a
            2-D matrix, `MUON_BATCHED` on fewer than 3 dimensions).
    """
    declared: dict[str, str] = {}
    embeddings: set[int] = set()
    for mod_name, module in model.named_modules():
        for key, label in getattr(module, "optimizer_routes", {}).items():
            if label not in ROUTE_LABELS:
                raise ConfigError(f"{type(module).__name__}.optimizer_routes[{key!r}] = {label!r}; the labels are "
                                  f"{ROUTE_LABELS}.")
            declared[f"{mod_name}.{key}" if mod_name else key] = label
        if isinstance(module, nn.Embedding):
            embeddings.add(id(module.weight))
        output = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if isinstance(output, nn.Module):
            embeddings.update(id(p) for p in output.parameters())
    routes: dict[str, str] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        label = next((declared[key] for key in (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                      if key in declared), None)
        if label is None:
            label = MUON if p.ndim == 2 and id(p) not in embeddings else ADAMW
        elif (label == MUON and p.ndim != 2) or (label == MUON_BATCHED and p.ndim < 3):
            raise ConfigError(f"parameter {name} of shape {tuple(p.shape)} is declared {label!r}: {MUON!r} takes a "
                              f"2-D matrix, {MUON_BATCHED!r} a stack [..., out, in] of matrices.")
        routes[name] = label
    return routes


@runtime_checkable
class QKClipTarget(Protocol):
    """An attention module QK-Clip acts on (checked structurally by `isinstance`).

    Attributes:
        num_heads: the number of heads whose logits are recorded and clipped.
        qk_clip_group: "text" or "vision" (`MuonClip(qk_clip_vision=False)` leaves "vision" targets alone).
        record_max_logits: set by the optimizer; while True, every forward folds its per-head max pre-softmax logit
            into `max_logits`.
        max_logits: `[num_heads]` fp32, the element-wise max over the forwards since the optimizer last reset it to
            None (None: nothing recorded).
    """

    num_heads: int
    qk_clip_group: str
    record_max_logits: bool
    max_logits: torch.Tensor | None

    def qk_clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(parameter, row_scale)` pairs that, applied as `parameter[i, ...] *= row_scale[i]`, multiply every
        pre-softmax logit of head `h` by `gamma[h]` and leave the other heads' logits unchanged.

        Args:
            gamma: `[num_heads]` fp32 on the CPU, each in (0, 1] (1 = leave the head alone).

        Returns:
            for each parameter to scale, `row_scale` `[parameter.shape[0]]` fp32 on the CPU.
        """
        ...


class MaxLogitRecorder:
    """The recording half of `QKClipTarget` for an `nn.Module` subclass: `record_max_logits` (off by default),
    `max_logits` and `fold_max_logits`."""

    record_max_logits: bool = False
    max_logits: torch.Tensor | None = None

    def fold_max_logits(self, m: torch.Tensor) -> None:
        """Fold one forward's per-head maxima `m` `[num_heads]` (fp32) into `max_logits` (element-wise max)."""
        self.max_logits = m if self.max_logits is None else torch.maximum(self.max_logits, m)
