"""Packed (varlen) attention: equals per-sequence dense attention, never mixes sequences, runs under bf16
autocast, validates inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimi_vl.errors import ShapeError
from kimi_vl.kernels import packed_attention


def dense_reference(q, k, v, lengths, scale=None):
    """Per-sequence softmax attention in float64 (explicit scores, no SDPA)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out.append((p @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).to(q.dtype)


def packed(lengths, H=3, D=8, Dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.randn(T, H, D, generator=gen) for _ in range(2))
    v = torch.randn(T, H, Dv or D, generator=gen)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("lengths", [[5], [4, 9, 1, 16], [5, 5, 5, 2], [6, 6, 6, 3, 6], [7, 0, 7, 2]])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_per_sequence_dense(lengths, scale):
    q, k, v, cu = packed(lengths, Dv=5)
    out = packed_attention(q, k, v, cu, scale=scale)
    assert out.shape == (sum(lengths), 3, 5)
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths, scale), rtol=1e-5, atol=1e-5)


def test_matches_block_diagonal_mask_and_int64_offsets():
    lengths = [3, 8, 8, 5]
    q, k, v, cu = packed(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seg[:, None] == seg[None, :]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    torch.testing.assert_close(packed_attention(q, k, v, cu.long()), ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_sequences_are_isolated_and_gradients_flow():
    q, k, v, cu = packed([4, 4, 6])
    q.requires_grad_(True)
    out = packed_attention(q, k, v, cu)
    v2 = v.clone()
    v2[8:] += 100.0  # perturb only the last sequence
    torch.testing.assert_close(packed_attention(q, k, v2, cu)[:8], out[:8])
    out[:4].sum().backward()
    assert q.grad[:4].abs().sum() > 0 and q.grad[4:].abs().sum() == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda q, k, v, cu: (q[0], k, v, cu),  # 2-D q
        lambda q, k, v, cu: (q, k[:-1], v, cu),  # k tokens differ
        lambda q, k, v, cu: (q, k, v[:, :2], cu),  # v heads differ
        lambda q, k, v, cu: (q, k, v, cu[None]),  # 2-D cu_seqlens
        lambda q, k, v, cu: (q, k, v, cu.float()),  # float offsets
        lambda q, k, v, cu: (q, k, v, cu + 1),  # does not start at 0
        lambda q, k, v, cu: (q, k, v, cu[:-1]),  # does not end at total_tokens
        lambda q, k, v, cu: (q, k, v, torch.tensor([0, 9, 4, 14], dtype=torch.int32)),  # decreasing
        lambda q, k, v, cu: (q, k, v, cu[:1]),  # no sequence
    ],
)
def test_bad_inputs_raise_shape_error(make):
    with pytest.raises(ShapeError):
        packed_attention(*make(*packed([4, 4, 6])))


@pytest.mark.parametrize("lengths", [[4, 9, 4], [5, 5]])  # equal lengths apart in the pack (a gather), side by side
def test_bf16_autocast_returns_qs_dtype(lengths):
    """Mixed-precision training: SDPA returns bf16 under autocast while q, from fp32 layers, is fp32; the output is
    in q's dtype on both paths (the gather path once failed: an index put of bf16 into fp32)."""
    q, k, v, cu = packed(lengths)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = packed_attention(q, k, v, cu)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths), rtol=0.05, atol=0.05)


@pytest.mark.parametrize(("T", "L"), [(0, 3), (3, 0), (0, 0)])
def test_max_logits_without_queries_or_keys_is_minus_inf(T, L):
    """No query or no key means no attended pair: every head's max logit is -inf, as documented."""
    from kimi_vl.kernels import max_logits

    out = max_logits(torch.randn(2, 3, T, 4), torch.randn(2, 3, L, 4), 0.5)
    assert out.shape == (3,) and bool((out == float("-inf")).all())
