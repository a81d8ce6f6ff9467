"""The residual stream: the one seam where sublayer outputs join the hidden state.

The model runs every sublayer (attention and FFN count separately) as
`h = stream.read(state, l)`, `out = sublayer(h)`, `state = stream.write(state, l, out)`, then
`stream.end(state)` before the final norm. `StandardResidual` is the PreNorm sum `h <- h + out`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

_checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def run_checkpointed(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`; while `module` trains with `gradient_checkpointing` on, through the checkpoint function that
    `activation_checkpointing_enable(...)` gave it (non-reentrant `torch.utils.checkpoint` when set by hand), so that
    `fn`'s intermediates are recomputed in the backward pass instead of kept."""
    if module.gradient_checkpointing and module.training:
        return getattr(module, "_gradient_checkpointing_func", _checkpoint)(fn, *args)
    return fn(*args)


class StandardResidual(nn.Module):
    """PreNorm residual: the state is the running sum `[B, T, hidden]`."""

    def begin(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds

    def read(self, state: torch.Tensor, sublayer: int) -> torch.Tensor:
        return state

    def write(self, state: torch.Tensor, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        return state + out

    def end(self, state: torch.Tensor) -> torch.Tensor:
        return state
