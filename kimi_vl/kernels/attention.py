"""Non-causal attention over packed variable-length sequences (the MoonViT image/frame packs), and the per-head
max pre-softmax logit that QK-Clip records (MLA and MoonViT attention share it).

`packed_attention` never builds a mask over the whole pack: sequences of equal length go into one batched
`F.scaled_dot_product_attention` call (a view when they are adjacent, a gather otherwise; a pack of many
same-size frames costs one call), and
each call sees only its own sequences, so memory stays O(sum of L_i^2) for the scores, not O((sum L_i)^2).

`max_logits` (batched `[B, h, T, D]` queries, causal or a boolean mask) and `packed_max_logits` (packed
`[total_tokens, h, D]` sequences, bidirectional or causal within each) compute `max q_i . k_j * scale` per head
over exactly the pairs the attention attends, in blocks of at most `MAX_LOGIT_BLOCK_ELEMENTS` scores, so the full
score matrix of a long sequence is never built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ShapeError
from .offsets import host_offsets


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
    offsets = host_offsets(cu_seqlens)
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
        )  # [n, H, L, Dv]; under autocast in its lower precision, `out` in q's
        out[index] = o.transpose(1, 2).to(out.dtype)
    return out


# Max-logit recording computes scores in blocks of at most this many elements (batch * heads * rows * keys).
MAX_LOGIT_BLOCK_ELEMENTS = 1 << 24


@torch.no_grad()
def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head max pre-softmax logit `max q_i . k_j * scale` over the attended pairs, in fp32.

    Args:
        q: `[B, heads, T, D]` queries; k: `[B, heads, L, D]` keys.
        scale: the softmax scale (> 0).
        causal: query `i` attends keys `j <= i` (top-left aligned, as SDPA's `is_causal`).
        mask: boolean `[B or 1, 1 or heads, T, L]`, True = attend (ignored when `causal`).

    Returns:
        `[heads]` fp32; -inf for a head with no attended pair.

    Scores are computed in blocks of at most `MAX_LOGIT_BLOCK_ELEMENTS` (query rows of whole batch elements, then
    several batch elements per block when a block holds all rows), and scaled after the max (scale > 0 and
    rounding is monotonic, so `max(x) * scale == max(x * scale)` exactly).
    """
    q, k = q.detach().float(), k.detach().float()
    B, heads, T, L = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask is not None and not causal:
        mask = mask.expand(B, mask.shape[1], T, L)
    rows = min(T, max(1, MAX_LOGIT_BLOCK_ELEMENTS // max(1, heads * L)))  # query rows per block
    batch = max(1, MAX_LOGIT_BLOCK_ELEMENTS // max(1, heads * rows * L))  # batch elements per block
    out = torch.full((heads,), float("-inf"), device=q.device)
    if T == 0 or L == 0:  # no query or no key: no attended pair
        return out
    for b0 in range(0, B, batch):
        kt = k[b0 : b0 + batch].mT
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            scores = q[b0 : b0 + batch, :, r0:r1] @ kt  # [batch, heads, rows, L]
            if causal:
                allowed = torch.ones(r1 - r0, L, dtype=torch.bool, device=q.device).tril(r0)
                scores = scores.masked_fill(~allowed, float("-inf"))
            elif mask is not None:
                scores = scores.masked_fill(~mask[b0 : b0 + batch, :, r0:r1], float("-inf"))
            out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out * scale


def packed_max_logits(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, *, causal: bool = False
) -> torch.Tensor:
    """Per-head max pre-softmax logit over the pairs inside each packed sequence (never across sequences), fp32.

    Args:
        q, k: `[total_tokens, heads, D]`.
        cu_seqlens: `[num_seqs + 1]` offsets (as `packed_attention`; empty sequences are skipped).
        scale: the softmax scale (> 0).
        causal: attention within a sequence is causal (MLA's packed rows) instead of bidirectional (MoonViT).

    Returns:
        `[heads]` fp32; -inf for an empty pack.

    Runs of adjacent equal-length sequences are viewed as one batch for `max_logits`, so a pack of many same-size
    frames costs few matmuls and no pack-wide mask is built.
    """
    q, k = q.detach().float(), k.detach().float()
    offsets = host_offsets(cu_seqlens)
    runs: list[list[int]] = []  # [start, length, count] of adjacent equal-length non-empty sequences
    for s, e in zip(offsets, offsets[1:]):
        if e == s:
            continue
        if runs and runs[-1][1] == e - s and runs[-1][0] + runs[-1][1] * runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([s, e - s, 1])
    out = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for start, length, count in runs:
        qs, ks = (x[start : start + length * count].unflatten(0, (count, length)).transpose(1, 2) for x in (q, k))
        out = torch.maximum(out, max_logits(qs, ks, scale, causal=causal))
    return out
