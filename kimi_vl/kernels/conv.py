"""Short depthwise causal convolution (the ``conv4`` in front of KDA's q/k/v), with a decode tail.

``y_t = act(sum_{i=0..K-1} weight[:, i] * x_{t-K+1+i})``; inputs before the start of a sequence are the
``tail`` (the previous K-1 inputs) or zeros.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from kimi_vl.errors import ShapeError
from kimi_vl.kernels.offsets import host_offsets


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tail: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    output_tail: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv over time.

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, K]`` depthwise kernel, no bias.
        tail: ``[N, D, K-1]`` previous K-1 inputs of each sequence (zeros if None); N = B, or the number of
            packed sequences with ``cu_seqlens``.
        cu_seqlens: ``[N+1]`` offsets of sequences packed along T (B must be 1); no sequence sees
            another's inputs.
        activation: ``"silu"`` or None.
        output_tail: also return the new tail.

    Returns:
        ``(y [B, T, D] in x's dtype, new_tail [N, D, K-1] or None)``; the new tail holds the last K-1 inputs
        of each sequence, reaching into the old tail when a sequence is shorter than K-1.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if x.dim() != 3:
        raise ShapeError(f"x must be [B, T, D], got {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ShapeError(f"weight {tuple(weight.shape)} must be [D, K] with D = {D} (x {tuple(x.shape)})")
    K = weight.shape[1]
    offsets = None
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or B != 1:
            raise ShapeError(
                f"cu_seqlens {tuple(cu_seqlens.shape)} must be [N+1] offsets with batch 1, x {tuple(x.shape)}"
            )
        offsets = host_offsets(cu_seqlens)
        if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in pairwise(offsets)):
            raise ShapeError(f"cu_seqlens {offsets} must rise from 0 to T={T}")
    n_seq = B if offsets is None else len(offsets) - 1
    if tail is not None and tuple(tail.shape) != (n_seq, D, K - 1):
        raise ShapeError(f"tail {tuple(tail.shape)} must be [N, D, K-1] = {(n_seq, D, K - 1)}")
    w = weight.to(x.dtype)
    if tail is not None:
        tail = tail.to(x.dtype)
    elif offsets is None:
        tail = x.new_zeros(n_seq, D, K - 1)

    if offsets is None and T == 1:
        window = torch.cat([tail, x.transpose(1, 2)], -1)  # [B, D, K]
        y = (window * w).sum(-1, keepdim=True).transpose(1, 2)
        new_tail = window[..., 1:]
    elif offsets is None:
        window = torch.cat([tail, x.transpose(1, 2)], -1)  # [B, D, K-1+T]
        y = (F.conv1d(window, w.unsqueeze(1), groups=D) if T else window[..., :0]).transpose(1, 2)
        new_tail = window[..., T:]
    else:
        # Lay the sequences out as [tail_0, x_0, tail_1, x_1, ...] so one conv never mixes sequences. Rows are
        # copied in and the outputs selected by index, so the backward gathers instead of scattering with
        # accumulation.
        lens = [b - a for a, b in pairwise(offsets)]
        x_pos, out_pos, tail_in, tail_pos, pos = [], [], [], [], 0
        for n in lens:
            tail_in += range(pos, pos + K - 1)
            x_pos += range(pos + K - 1, pos + K - 1 + n)
            out_pos += range(pos, pos + n)
            tail_pos += range(pos + n, pos + n + K - 1)
            pos += n + K - 1

        def index(positions: list[int]) -> torch.Tensor:
            return torch.tensor(positions, dtype=torch.long, device=x.device)

        window = x.new_zeros(pos, D).index_copy(0, index(x_pos), x[0])
        if tail is not None:  # else the zeros stay
            window = window.index_copy(0, index(tail_in), tail.transpose(1, 2).reshape(n_seq * (K - 1), D))
        window = window.t().unsqueeze(0)
        y = window[..., :0] if T == 0 else F.conv1d(window, w.unsqueeze(1), groups=D)
        # whole rows of the [L, D] view selected, and kept row-major: the ops after the conv read [1, T, D] rows
        # faster than a transposed [1, D, T] selection (the pre-training step 0.94x, docs/RESULTS.md)
        y = y[0].t().index_select(0, index(out_pos)).unsqueeze(0)
        if output_tail:
            new_tail = window[0].index_select(-1, index(tail_pos)).reshape(D, n_seq, K - 1).transpose(0, 1)
    if activation == "silu":
        y = F.silu(y)
    return y, new_tail.contiguous() if output_tail else None
