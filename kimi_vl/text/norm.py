"""RMSNorm and the gated RMSNorm of the KDA output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """T5/Llama RMSNorm: `weight * (x / sqrt(mean(x^2) + eps))`, normalised in fp32, cast back before the weight.

    Shapes: `[..., dim] -> [..., dim]`.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """`RMSNorm(x) * weight * sigmoid(gate)`, entirely in fp32 (the KDA output norm).

    Shapes: x, gate `[..., head_dim]` -> `[..., head_dim]` in x's dtype.
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * F.sigmoid(gate.float())).to(x.dtype)
