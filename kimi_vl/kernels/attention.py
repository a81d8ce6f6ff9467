"""Non-causal attention over packed variable-length sequences (the MoonViT image/frame packs).

`packed_attention` never builds a mask over the whole pack: sequences of equal length go into one batched
`F.scaled_dot_product_attention` call (a view when they are adjacent, a gather otherwise; a pack of many
same-size frames costs one call), and
each call sees only its own sequences, so memory stays O(sum of L_i^2) for the scores, not O((sum L_i)^2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ShapeError


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> list[int]:
    """Validate the packed layout and return the sequence offsets as Python ints."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ShapeError(
            f"q, k, v must be [total_tokens, heads, head_dim]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}."
        )
    if q.shape != k.shape or v.shape[:2] != q.shape[:2]:
        raise ShapeError(
            f"q and k must have the same shape and v the same tokens and heads; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ShapeError(
            f"cu_seqlens must be a 1-D integer tensor [num_seqs + 1] of offsets starting at 0; got "
            f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}."
        )
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or offsets[-1] != q.shape[0] or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ShapeError(
            f"cu_seqlens must be non-decreasing offsets from 0 to total_tokens={q.shape[0]}; got "
            f"{offsets[:8]}{'...' if len(offsets) > 8 else ''} (last {offsets[-1]})."
        )
    return offsets


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Bidirectional attention inside each packed sequence; tokens never attend across sequences.

    Args:
        q, k: `[total_tokens, heads, head_dim]`.
        v: `[total_tokens, heads, v_head_dim]`.
        cu_seqlens: `[num_seqs + 1]` integer offsets, `cu_seqlens[0] == 0`, `cu_seqlens[-1] == total_tokens`
            (zero-length sequences are allowed and skipped).
        scale: softmax scale, default `head_dim ** -0.5`.

    Returns:
        `[total_tokens, heads, v_head_dim]`, in `q`'s dtype.

    Raises:
        ShapeError: on mismatched shapes or invalid `cu_seqlens`.
    """
    offsets = _check(q, k, v, cu_seqlens)
    starts_by_len: dict[int, list[int]] = {}
    for start, end in zip(offsets, offsets[1:]):
        if end > start:
            starts_by_len.setdefault(end - start, []).append(start)

    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for length, starts in starts_by_len.items():
        n = len(starts)
        if starts[-1] - starts[0] == (n - 1) * length:  # adjacent in the pack (or alone): a view, no gather copy
            sl = slice(starts[0], starts[0] + n * length)
            qb, kb, vb = (x[sl].view(n, length, *x.shape[1:]) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), scale=scale)
            out[sl] = o.transpose(1, 2).reshape(n * length, *out.shape[1:])  # [n, H, L, Dv] -> [n*L, H, Dv]
            continue
        index = torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)  # [n, L]
        o = F.scaled_dot_product_attention(
            q[index].transpose(1, 2), k[index].transpose(1, 2), v[index].transpose(1, 2), scale=scale
        )  # [n, H, L, Dv]
        out[index] = o.transpose(1, 2)
    return out
