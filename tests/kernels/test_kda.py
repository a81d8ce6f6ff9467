"""KDA ops: chunked vs token-by-token reference, varlen, hard resets, decode continuation, dtypes, errors."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from kimi_vl.errors import ShapeError
from kimi_vl.kernels import chunk_kda, fused_recurrent_kda, naive_chunk_kda, naive_recurrent_kda
from kimi_vl.kernels.kda import _DiagBlockScores

NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(B=2, T=65, H=3, Dk=48, Dv=80, n_state=None, gate_div=1.0, seed=0, dtype=torch.float64):
    """q, k, v, g, beta, h0 (h0 is [n_state or B, H, Dk, Dv]) in `dtype`, fla-test style."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v = rnd(B, T, H, Dk), rnd(B, T, H, Dk), rnd(B, T, H, Dv)
    g = F.logsigmoid(rnd(B, T, H, Dk)) / gate_div
    beta = rnd(B, T, H).sigmoid()
    h0 = rnd(n_state or B, H, Dk, Dv)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0)]


def run(fn, inputs, use_h0=True, seed=1, **kw):
    """Forward + backward of loss = (o*do).sum() + (ht*dht).sum(); returns dict of o, ht and the input grads."""
    q, k, v, g, beta, h0 = (x.detach().clone().requires_grad_() for x in inputs)
    o, ht = fn(q, k, v, g, beta, initial_state=h0 if use_h0 else None, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device, ht.dtype)
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (q, k, v, g, beta, h0)]
    return dict(zip(NAMES, [o.detach(), ht.detach(), *grads], strict=True))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T", [1, 63, 65, 333])
@pytest.mark.parametrize("use_h0,l2", [(True, True), (False, False), (True, False)])
def test_chunk_matches_naive_float64(T, use_h0, l2):
    inputs = make_inputs(T=T)
    if not l2:  # the delta rule is only stable for |k| <= 1: normalise outside the kernel instead
        inputs[:2] = [F.normalize(x, dim=-1) for x in inputs[:2]]
    ref = run(naive_recurrent_kda, inputs, use_h0, use_qk_l2norm=l2)
    out = run(chunk_kda, inputs, use_h0, use_qk_l2norm=l2)
    for name in NAMES:
        assert (out[name] - ref[name]).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("T", [1, 63, 65, 333])
@pytest.mark.parametrize("gate_div", [1.0, 10.0])
def test_chunk_float32_matches_float64_reference(T, gate_div):
    inputs = make_inputs(T=T, gate_div=gate_div)
    ref = run(naive_recurrent_kda, inputs, use_qk_l2norm=True)
    out = run(chunk_kda, [x.float() for x in inputs], use_qk_l2norm=True)
    assert out["o"].dtype == torch.float32 and out["ht"].dtype == torch.float32
    for name in NAMES:
        assert rel(out[name], ref[name]) < 1e-5, name


def test_fused_recurrent_matches_naive_float64():
    inputs = make_inputs(T=20)
    ref = run(naive_recurrent_kda, inputs, use_qk_l2norm=True, scale=0.3)
    out = run(fused_recurrent_kda, inputs, use_qk_l2norm=True, scale=0.3)
    for name in NAMES:
        assert (out[name] - ref[name]).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("offsets", [[0, 15, 100, 170], [0, 15, 200, 200, 270]])  # 15, 85, 70 / 15, 185, 0, 70 tokens
@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda, fused_recurrent_kda])
def test_varlen_equals_separate_calls(fn, offsets):
    inputs = make_inputs(B=1, T=offsets[-1], H=2, Dk=32, Dv=40, n_state=len(offsets) - 1)
    packed = run(fn, inputs, cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
    q, k, v, g, beta, h0 = (x.detach().requires_grad_() for x in inputs)
    outs, finals = [], []
    for i, (a, b) in enumerate(pairwise(offsets)):
        o, ht = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[i:i + 1],
                   output_final_state=True)
        outs.append(o)
        finals.append(ht)
    o, ht = torch.cat(outs, 1), torch.cat(finals)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    ((o * do).sum() + (ht * dht).sum()).backward()
    separate = dict(zip(NAMES, [o, ht, q.grad, k.grad, v.grad, g.grad, beta.grad, h0.grad], strict=True))
    for name in NAMES:  # relative: these unnormalised inputs give values up to 1e13; the packed call batches
        # the sequences' chunks together, so float64 sums may round in another order
        err = (packed[name] - separate[name]).abs().max().item()
        assert err <= 1e-13 * separate[name].abs().max().item(), (name, err)


def test_hard_reset_stays_finite_and_forgets_the_past():
    T, reset = 150, 70
    q, k, v, g, beta, h0 = make_inputs(B=1, T=T, H=2, Dk=32, Dv=32, dtype=torch.float32)
    g[:, [5, 40, reset]] = -1000.0
    out = run(chunk_kda, [q, k, v, g, beta, h0], use_qk_l2norm=True)
    for name in NAMES:
        assert torch.isfinite(out[name]).all(), name
    ref = run(naive_recurrent_kda, [x.double() for x in (q, k, v, g, beta, h0)], use_qk_l2norm=True)
    for name in ("o", "ht", "dq", "dk", "dv", "dbeta", "dh0"):
        assert rel(out[name], ref[name]) < 1e-4, name

    # After the reset the state must not depend on anything before it: change all earlier tokens.
    q2, k2, v2, beta2 = (x.clone() for x in (q, k, v, beta))
    for x in (q2, k2, v2, beta2):
        x[:, :reset] = torch.randn_like(x[:, :reset])
    kw = dict(output_final_state=True, use_qk_l2norm=True)
    o1, h1 = chunk_kda(q, k, v, g, beta, initial_state=h0, **kw)
    o2, h2 = chunk_kda(q2, k2, v2, g, beta2, **kw)
    assert torch.allclose(h1, h2, atol=1e-5, rtol=1e-5)
    assert torch.allclose(o1[:, reset:], o2[:, reset:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reset", [-1e4, -1e8, float("-inf")])
def test_very_negative_gates_keep_float32_accuracy(reset):
    """A gate far below exp's range (-inf: the decay is exactly 0) must not cost the other tokens' decays their
    precision through the in-chunk cumulative sums, nor turn -inf - -inf into NaN."""
    q, k, v, g, beta, h0 = make_inputs(B=1, T=70, H=2, Dk=16, Dv=16, gate_div=10.0)
    g[:, [3, 40]] = reset
    ref = run(naive_recurrent_kda, [q, k, v, g, beta, h0], use_qk_l2norm=True)
    out = run(chunk_kda, [x.float() for x in (q, k, v, g, beta, h0)], use_qk_l2norm=True)
    for name in ("o", "ht", "dq", "dk", "dv", "dbeta", "dh0"):
        assert torch.isfinite(out[name]).all(), name
        assert rel(out[name], ref[name]) < 1e-5, name


@pytest.mark.parametrize("T,steps", [(100, 5), (64, 3), (7, 2)])
def test_fused_recurrent_continues_chunk_prefill(T, steps):
    q, k, v, g, beta, h0 = make_inputs(B=2, T=T + steps, H=2, Dk=32, Dv=48, dtype=torch.float32)
    kw = dict(output_final_state=True, use_qk_l2norm=True)
    o_full, h_full = chunk_kda(q, k, v, g, beta, initial_state=h0, **kw)
    o, state = chunk_kda(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], initial_state=h0, **kw)
    outs = [o]
    for t in range(T, T + steps):
        sl = slice(t, t + 1)
        o_t, state = fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state, **kw)
        outs.append(o_t)
    assert rel(torch.cat(outs, 1), o_full) < 1e-5
    assert rel(state, h_full) < 1e-5


def test_bfloat16_inputs():
    inputs = make_inputs(B=1, T=100, H=2, Dk=32, Dv=32, dtype=torch.float32)
    ref = run(chunk_kda, inputs, use_qk_l2norm=True)
    low = [x.bfloat16() for x in inputs[:5]] + [inputs[5]]
    out = run(chunk_kda, low, use_qk_l2norm=True)
    assert out["o"].dtype == torch.bfloat16 and out["ht"].dtype == torch.float32
    assert out["dq"].dtype == torch.bfloat16
    assert rel(out["o"], ref["o"]) < 2e-2
    assert rel(out["ht"], ref["ht"]) < 2e-2


@pytest.mark.parametrize("T", [128, 100])
def test_parity_with_transformers_torch_fallback(T):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, g, beta, h0 = make_inputs(B=2, T=T, H=2, Dk=64, Dv=64, dtype=torch.float32)
    o_ref, h_ref = chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    assert rel(o, o_ref) < 1e-5
    assert rel(ht, h_ref) < 1e-5


def test_reference_env_override(monkeypatch):
    inputs = make_inputs(T=10, dtype=torch.float32)
    monkeypatch.setenv("KIMI_VL_KERNELS", "reference")
    o, ht = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


def test_diag_block_scores_gradcheck():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 16, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    G = F.logsigmoid(torch.randn(2, 16, 3, generator=gen, dtype=torch.float64)).cumsum(-2).requires_grad_()
    assert torch.autograd.gradcheck(lambda *x: _DiagBlockScores.apply(*x), (q, k, G))


def test_diag_block_scores_kept_and_recomputed_decay_give_the_same_gradients(monkeypatch):
    """Below `_KEEP_BUDGET` the pairwise decay is kept for backward, above it recomputed: the same values either way
    (exactly: the same ops on the same groups of blocks), here with several groups (a small group budget)."""
    import kimi_vl.kernels.kda as kda

    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(5, 16, 8, generator=gen) for _ in range(2)]
    base.append(F.logsigmoid(torch.randn(5, 16, 8, generator=gen)).cumsum(-2))
    weights = [torch.randn(5, 16, 16, generator=gen) for _ in range(2)]
    monkeypatch.setattr(kda, "_groups", lambda m, per_item: [slice(i, min(i + 2, m)) for i in range(0, m, 2)])
    results = []
    for budget in (1 << 23, 0):
        monkeypatch.setattr(kda, "_KEEP_BUDGET", budget)
        inputs = [t.clone().requires_grad_() for t in base]
        kk, qk = _DiagBlockScores.apply(*inputs)
        ((kk * weights[0]).sum() + (qk * weights[1]).sum()).backward()
        results.append([kk.detach(), qk.detach(), *(t.grad for t in inputs)])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_no_final_state_unless_requested():
    q, k, v, g, beta, _ = make_inputs(T=5, dtype=torch.float32)
    for fn in (chunk_kda, fused_recurrent_kda, naive_recurrent_kda):
        o, ht = fn(q, k, v, g, beta)
        assert ht is None and o.shape == v.shape


BAD = {
    "k": lambda q, k, v, g, beta, h0: dict(k=k[..., :-1]),
    "v_time": lambda q, k, v, g, beta, h0: dict(v=v[:, :-1]),
    "g": lambda q, k, v, g, beta, h0: dict(g=g[:, :, :1]),
    "beta": lambda q, k, v, g, beta, h0: dict(beta=beta[..., None]),
    "h0": lambda q, k, v, g, beta, h0: dict(initial_state=h0[..., :-1]),
}


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda, naive_recurrent_kda])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_shapes_raise(fn, case):
    q, k, v, g, beta, h0 = make_inputs(T=5, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    bad = BAD[case](q, k, v, g, beta, h0)
    args.update(bad)
    with pytest.raises(ValueError) as info:
        fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), **args)
    assert isinstance(info.value, ShapeError)
    assert str(tuple(next(iter(bad.values())).shape)) in str(info.value)


def test_cu_seqlens_needs_batch_one():
    q, k, v, g, beta, _ = make_inputs(B=2, T=10, dtype=torch.float32)
    with pytest.raises(ShapeError, match="batch size 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 10]))
    q, k, v, g, beta, _ = make_inputs(B=1, T=10, dtype=torch.float32)
    with pytest.raises(ShapeError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))


@pytest.mark.parametrize("T", [1, 63, 65, 130])
@pytest.mark.parametrize("use_h0,l2", [(True, True), (False, False)])
def test_naive_chunk_matches_the_recurrence_float64(T, use_h0, l2):
    inputs = make_inputs(B=2, T=T, H=2, Dk=16, Dv=24)
    if not l2:
        inputs[:2] = [F.normalize(x, dim=-1) for x in inputs[:2]]
    ref = run(naive_recurrent_kda, inputs, use_h0, use_qk_l2norm=l2, scale=0.4)
    out = run(naive_chunk_kda, inputs, use_h0, use_qk_l2norm=l2, scale=0.4)
    for name in NAMES:
        assert (out[name] - ref[name]).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("use_h0", [True, False])
def test_naive_chunk_varlen_matches_the_recurrence_float64(use_h0):
    cu = torch.tensor([0, 15, 100, 101, 170], dtype=torch.int32)  # chunk-crossing, one-token and odd lengths
    inputs = make_inputs(B=1, T=170, H=2, Dk=16, Dv=24, n_state=4)
    ref = run(naive_recurrent_kda, inputs, use_h0, use_qk_l2norm=True, cu_seqlens=cu)
    out = run(naive_chunk_kda, inputs, use_h0, use_qk_l2norm=True, cu_seqlens=cu)
    for name in NAMES:
        assert (out[name] - ref[name]).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_fp32_inputs_stay_fp32_under_bf16_autocast(fn):
    """Mixed-precision training (`--precision bf16`) runs the model under autocast: the kernel still computes in
    fp32 (autocast would run its matmuls in bf16, ~1e-3 off)."""
    inputs = make_inputs(B=1, T=64, H=2, Dk=32, Dv=32, dtype=torch.float32)
    ref = run(fn, inputs, use_qk_l2norm=True)

    def autocast_forward(*args, **kw):  # the backward outside autocast, as torch recommends and the trainer does
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args, **kw)

    out = run(autocast_forward, inputs, use_qk_l2norm=True)
    for name in NAMES:
        assert out[name].dtype == torch.float32
        assert rel(out[name], ref[name]) < 1e-6, name
