"""Short causal conv: prefill parity with transformers, decode with tails, varlen isolation, errors."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kimi_vl.errors import ShapeError
from kimi_vl.kernels import causal_conv1d


def data(B=2, T=11, D=6, K=4, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, D, generator=gen, dtype=dtype), torch.randn(D, K, generator=gen, dtype=dtype))


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_prefill_matches_transformers(activation, T):
    from transformers.models.kimi_linear.modeling_kimi_linear import causal_conv1d_fn

    x, w = data(T=T, dtype=torch.float32)
    ref = causal_conv1d_fn(x.transpose(1, 2), w, activation=activation).transpose(1, 2)
    y, _ = causal_conv1d(x, w, activation=activation)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [0, 2, 7])
def test_decode_with_tails_continues_prefill(split):
    x, w = data(T=12)
    full, full_tail = causal_conv1d(x, w, output_tail=True)
    y, tail = causal_conv1d(x[:, :split], w, output_tail=True)
    outs = [y]
    for t in range(split, x.shape[1]):
        y, tail = causal_conv1d(x[:, t:t + 1], w, tail=tail, output_tail=True)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(tail, full_tail, rtol=0, atol=0)


def test_chunked_prefill_and_short_tail():
    x, w = data(T=9, K=4)
    full, full_tail = causal_conv1d(x, w, output_tail=True)
    y1, t1 = causal_conv1d(x[:, :5], w, output_tail=True)
    y2, t2 = causal_conv1d(x[:, 5:6], w, tail=t1, output_tail=True)
    y3, t3 = causal_conv1d(x[:, 6:], w, tail=t2, output_tail=True)
    torch.testing.assert_close(torch.cat([y1, y2, y3], 1), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(t3, full_tail)
    # A chunk shorter than K-1 keeps part of the old tail.
    _, t = causal_conv1d(x[:, :1], w, tail=t1, output_tail=True)
    torch.testing.assert_close(t, torch.cat([t1[..., 1:], x[:, :1].transpose(1, 2)], -1))


def test_varlen_isolation_and_tails():
    offsets = [0, 2, 9, 15]
    x, w = data(B=1, T=15)
    gen = torch.Generator().manual_seed(3)
    tails = torch.randn(3, x.shape[2], w.shape[1] - 1, generator=gen, dtype=x.dtype)
    x.requires_grad_()
    cu = torch.tensor(offsets, dtype=torch.int32)
    for tail in (None, tails):
        y, new_tail = causal_conv1d(x, w, cu_seqlens=cu, tail=tail, output_tail=True)
        parts = [causal_conv1d(x[:, a:b], w, tail=None if tail is None else tail[i:i + 1], output_tail=True)
                 for i, (a, b) in enumerate(pairwise(offsets))]
        torch.testing.assert_close(y, torch.cat([p[0] for p in parts], 1), rtol=0, atol=1e-12)
        torch.testing.assert_close(new_tail, torch.cat([p[1] for p in parts]), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), x)
    (grad_sep,) = torch.autograd.grad(torch.cat([p[0] for p in parts], 1).sum(), x)
    torch.testing.assert_close(grad, grad_sep)


def test_bad_inputs_raise():
    x, w = data()
    with pytest.raises(ShapeError, match=r"\(5, 4\)"):
        causal_conv1d(x, w[:5])
    with pytest.raises(ShapeError, match=r"\(2, 6, 2\)"):
        causal_conv1d(x, w, tail=torch.zeros(2, 6, 2, dtype=x.dtype))
    with pytest.raises(ShapeError, match="x must be"):
        causal_conv1d(x[0], w)
    with pytest.raises(ShapeError, match="cu_seqlens"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 5, 11]))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="gelu")
