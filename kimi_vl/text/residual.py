"""The residual stream: the one seam where sublayer outputs join the hidden state.

The model runs every sublayer (attention and FFN count separately) as
`h = stream.read(state, l)`, `out = sublayer(h)`, `state = stream.write(state, l, out)`, then
`stream.end(state)` before the final norm. `StandardResidual` is the PreNorm sum `h <- h + out`.
"""

from __future__ import annotations

import torch
from torch import nn


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
