"""Triton kernels for Kimi Delta Attention (KDA); same contract as :mod:`kimi_vl.kernels.kda`.

* :func:`fused_recurrent_kda_triton` - decode path, forward only. One program per (sequence, head, V block)
  keeps its ``[Dk, BV]`` slice of the state in fp32 registers and walks the tokens; L2 norm of q/k, scale,
  initial/final state and packed sequences (``cu_seqlens``) are fused in.
* :func:`chunk_kda_triton` - chunked prefill/training path (chunk 64, sub-chunk 16), four kernels:

  1. ``_chunk_prep_kernel``: per (chunk, head): optional q/k L2 norm, scale, in-chunk cumulative gate sum G.
  2. ``_chunk_intra_kernel``: per (chunk, head): ``A_kk`` / ``A_qk``. Blocks below the 16x16 block diagonal
     are matmuls with the decay split at the first token n of the row sub-chunk,
     ``(x_i e^{G_i - G_n}) . (k_j e^{G_n - G_j})`` (both factors <= 1); the diagonal sub-blocks use the
     element-wise pairwise decay with the non-causal half masked to -inf *before* the exp.
  3. ``_chunk_ut_kernel``: per (chunk, head): ``M = (I + diag(beta) A_kk)^-1`` by forward substitution on
     chip, then ``W = M diag(beta) (exp(G) K)`` and ``U = M diag(beta) V``.
  4. ``_chunk_state_kernel``: per (sequence, head, V block): the sequential pass over the chunks with the
     fp32 state in registers, ``V_new = U - W S``, ``O = (Q exp(G)) S + tril(A_qk) V_new``,
     ``S <- exp(G_last) S + (K exp(G_last - G))^T V_new``.

  **Backward is torch-backed**: :class:`ChunkKDAFunction` runs the Triton forward, and its backward
  recomputes the forward with the differentiable torch path (:func:`kimi_vl.kernels.kda.chunk_kda_torch`)
  under autograd and back-propagates through it. Gradients are therefore exactly the torch path's, but the
  backward costs a torch forward + backward.

Tokens are handled as one packed stream ``[B*T, H, D]``: a fixed-length batch is the packed case with
offsets ``0, T, 2T, ...``. All kernels accumulate in fp32; fp32 inputs use IEEE-precision dots, bf16/fp16
inputs tf32 dots. On CPU the kernels only run under the Triton interpreter, which must be enabled by setting
``TRITON_INTERPRET=1`` before triton is first imported.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import triton
import triton.language as tl

CHUNK = 64
SUB_CHUNK = 16
L2_EPS = 1e-6


def interpreting() -> bool:
    """True when triton was imported with ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old/new triton layouts
        return False
    return isinstance(tl.standard.sum, InterpretedFunction)


def _require_runnable(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "the Triton KDA kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is first imported "
            f"(got {x.device} tensors); use KIMI_VL_KERNELS=torch for the PyTorch path"
        )


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _offsets_tensor(offsets: list[int] | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    if offsets is None:
        offsets = [b * T for b in range(B + 1)]
    return torch.tensor(offsets, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------------------------
# Recurrent (decode) kernel
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _recurrent_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu, scale,
    H, K, V,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, L2: tl.constexpr, EPS: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    m_s = mk[:, None] & mv[None, :]
    s_off = ((i_n * H + i_h) * K + rk[:, None]).to(tl.int64) * V + rv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + s_off, mask=m_s, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        k_off = (t * H + i_h) * K + rk
        b_q = tl.load(q + k_off, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k + k_off, mask=mk, other=0.0).to(tl.float32)
        b_g = tl.load(g + k_off, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + rv, mask=mv, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * H + i_h).to(tl.float32)
        if L2:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + EPS)
        b_q = b_q * scale
        S = S * tl.exp(b_g)[:, None]
        pred = tl.sum(S * b_k[:, None], 0)
        S += b_k[:, None] * (b_beta * (b_v - pred))[None, :]
        b_o = tl.sum(S * b_q[:, None], 0)
        tl.store(o + (t * H + i_h) * V + rv, b_o.to(o.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(ht + s_off, S, mask=m_s)


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    offsets: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only recurrent KDA (no autograd); inputs already validated (``offsets`` from ``_check``)."""
    _require_runnable(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None and offsets is None:
        offsets = [int(x) for x in cu_seqlens.tolist()]
    cu = _offsets_tensor(offsets, B, T, q.device)
    N = cu.numel() - 1
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    BK, BV = _block(K), min(_block(V), 64)
    grid = (N, H, triton.cdiv(V, BV))
    _recurrent_fwd_kernel[grid](
        q, k, v, g, beta, o, h0, ht, cu, K**-0.5 if scale is None else scale,
        H, K, V,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, L2=use_qk_l2norm, EPS=L2_EPS,
        BK=BK, BV=BV,
    )
    return o, ht if output_final_state else None


# ----------------------------------------------------------------------------------------------------------
# Chunked kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_prep_kernel(
    q, k, g, qn, kn, gc, chunks, scale,
    H, K,
    L2: tl.constexpr, EPS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + 2 * i_c).to(tl.int64)
    eos = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    rt = bos + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    m = (rt < eos)[:, None] & (rk < K)[None, :]
    off = (rt[:, None] * H + i_h) * K + rk[None, :]
    b_q = tl.load(q + off, mask=m, other=0.0).to(tl.float32)
    b_k = tl.load(k + off, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    if L2:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + EPS)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + EPS)[:, None]
    tl.store(qn + off, b_q * scale, mask=m)
    tl.store(kn + off, b_k, mask=m)
    tl.store(gc + off, tl.cumsum(b_g, 0), mask=m)


@triton.jit
def _chunk_intra_kernel(
    qn, kn, gc, akk, aqk, chunks,
    H, K,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + 2 * i_c).to(tl.int64)
    eos = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    mk = rk < K
    causal = rc[:, None] >= rc[None, :]
    for i in tl.static_range(BT // BC):
        ri = bos + i * BC + rc
        mi = (ri < eos)[:, None] & mk[None, :]
        off_i = (ri[:, None] * H + i_h) * K + rk[None, :]
        b_qi = tl.load(qn + off_i, mask=mi, other=0.0)
        b_ki = tl.load(kn + off_i, mask=mi, other=0.0)
        b_gi = tl.load(gc + off_i, mask=mi, other=0.0)
        a_off = (ri[:, None] * H + i_h) * BT + rc[None, :]
        a_mask = (ri < eos)[:, None]
        # Diagonal sub-block: pairwise decay exp(G_a - G_b), b <= a, masked to -inf before the exp; the
        # [BC, BC, BKD] products are built BKD key channels at a time to bound register use.
        keep = (causal & (ri < eos)[:, None])[:, :, None]  # padded rows hold G = 0: differences may be large
        d_kk = tl.zeros([BC, BC], dtype=tl.float32)
        d_qk = tl.zeros([BC, BC], dtype=tl.float32)
        for kk in tl.static_range(0, BK, BKD):
            rd = kk + tl.arange(0, BKD)
            md = (ri < eos)[:, None] & (rd < K)[None, :]
            off_d = (ri[:, None] * H + i_h) * K + rd[None, :]
            d_q = tl.load(qn + off_d, mask=md, other=0.0)
            d_k = tl.load(kn + off_d, mask=md, other=0.0)
            d_g = tl.load(gc + off_d, mask=md, other=0.0)
            decay = tl.exp(tl.where(keep, d_g[:, None, :] - d_g[None, :, :], float("-inf")))
            kd = d_k[None, :, :] * decay
            d_kk += tl.sum(d_k[:, None, :] * kd, 2)
            d_qk += tl.sum(d_q[:, None, :] * kd, 2)
        tl.store(akk + a_off + i * BC, tl.where(rc[:, None] > rc[None, :], d_kk, 0.0), mask=a_mask)
        tl.store(aqk + a_off + i * BC, d_qk, mask=a_mask)
        if i > 0:
            # Off-diagonal sub-blocks: decay split at the first token n of this row sub-chunk.
            n = bos + i * BC
            g_ref = tl.load(gc + (n * H + i_h) * K + rk, mask=mk & (n < eos), other=0.0)
            row_decay = tl.exp(tl.where(mi, b_gi - g_ref[None, :], 0.0))
            b_kr = b_ki * row_decay
            b_qr = b_qi * row_decay
            for j in tl.static_range(i):
                rj = bos + j * BC + rc
                mj = (rj < eos)[:, None] & mk[None, :]
                off_j = (rj[:, None] * H + i_h) * K + rk[None, :]
                b_kj = tl.load(kn + off_j, mask=mj, other=0.0)
                b_gj = tl.load(gc + off_j, mask=mj, other=0.0)
                b_kc = tl.trans(b_kj * tl.exp(tl.where(mj & (n < eos), g_ref[None, :] - b_gj, 0.0)))
                tl.store(akk + a_off + j * BC, tl.dot(b_kr, b_kc, input_precision=PREC), mask=a_mask)
                tl.store(aqk + a_off + j * BC, tl.dot(b_qr, b_kc, input_precision=PREC), mask=a_mask)
        for j in tl.static_range(i + 1, BT // BC):
            zero = tl.zeros([BC, BC], dtype=tl.float32)
            tl.store(akk + a_off + j * BC, zero, mask=a_mask)
            tl.store(aqk + a_off + j * BC, zero, mask=a_mask)


@triton.jit
def _chunk_ut_kernel(
    kn, gc, v, beta, akk, w, u, chunks,
    H, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + 2 * i_c).to(tl.int64)
    eos = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    r = tl.arange(0, BT)
    rt = bos + r
    mt = rt < eos
    b_beta = tl.load(beta + rt * H + i_h, mask=mt, other=0.0).to(tl.float32)
    b_a = tl.load(akk + (rt[:, None] * H + i_h) * BT + r[None, :], mask=mt[:, None], other=0.0)
    L = tl.where(r[:, None] > r[None, :], b_a * b_beta[:, None], 0.0)
    # Forward substitution: row i of M = (I + L)^-1 is e_i - sum_{j<i} L_ij M_j.
    M = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BT):
        l_i = tl.sum(tl.where(r[:, None] == i, L, 0.0), 0)
        m_i = tl.sum(l_i[:, None] * M, 0)
        M = tl.where(r[:, None] == i, M - m_i[None, :], M)
    rk = tl.arange(0, BK)
    mk2 = mt[:, None] & (rk < K)[None, :]
    off_k = (rt[:, None] * H + i_h) * K + rk[None, :]
    b_k = tl.load(kn + off_k, mask=mk2, other=0.0)
    b_g = tl.load(gc + off_k, mask=mk2, other=0.0)
    b_kb = b_k * tl.exp(b_g) * b_beta[:, None]
    tl.store(w + off_k, tl.dot(M, b_kb, input_precision=PREC), mask=mk2)
    rv = tl.arange(0, BV)
    mv2 = mt[:, None] & (rv < V)[None, :]
    off_v = (rt[:, None] * H + i_h) * V + rv[None, :]
    b_v = tl.load(v + off_v, mask=mv2, other=0.0).to(tl.float32) * b_beta[:, None]
    tl.store(u + off_v, tl.dot(M, b_v, input_precision=PREC), mask=mv2)


@triton.jit
def _chunk_state_kernel(
    qn, kn, gc, w, u, aqk, o, h0, ht, cu,
    H, K, V,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    r = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    m_s = mk[:, None] & mv[None, :]
    s_off = ((i_n * H + i_h) * K + rk[:, None]).to(tl.int64) * V + rv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + s_off, mask=m_s, other=0.0).to(tl.float32)
    causal = r[:, None] >= r[None, :]
    for cs in range(bos, eos, BT):
        rt = cs + r
        mt = rt < eos
        m_k = mt[:, None] & mk[None, :]
        m_v = mt[:, None] & mv[None, :]
        off_k = (rt[:, None] * H + i_h) * K + rk[None, :]
        off_v = (rt[:, None] * H + i_h) * V + rv[None, :]
        b_w = tl.load(w + off_k, mask=m_k, other=0.0)
        b_u = tl.load(u + off_v, mask=m_v, other=0.0)
        b_q = tl.load(qn + off_k, mask=m_k, other=0.0)
        b_k = tl.load(kn + off_k, mask=m_k, other=0.0)
        b_g = tl.load(gc + off_k, mask=m_k, other=0.0)
        last = tl.minimum(cs + BT, eos) - 1
        g_last = tl.load(gc + (last * H + i_h) * K + rk, mask=mk, other=0.0)
        b_a = tl.load(aqk + (rt[:, None] * H + i_h) * BT + r[None, :], mask=mt[:, None], other=0.0)
        b_a = tl.where(causal, b_a, 0.0)
        v_new = b_u - tl.dot(b_w, S, input_precision=PREC)
        b_o = tl.dot(b_q * tl.exp(b_g), S, input_precision=PREC) + tl.dot(b_a, v_new, input_precision=PREC)
        tl.store(o + off_v, b_o.to(o.dtype.element_ty), mask=m_v)
        b_kg = b_k * tl.exp(tl.where(m_k, g_last[None, :] - b_g, float("-inf")))
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(b_kg), v_new, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + s_off, S, mask=m_s)


def _chunk_table(cu_list: list[int], device: torch.device) -> torch.Tensor:
    """``[n_chunks, 2]`` int32 (first token, end token) of every chunk of every packed sequence."""
    rows = [(s, min(s + CHUNK, b)) for a, b in pairwise(cu_list) for s in range(a, b, CHUNK)]
    return torch.tensor(rows or [(0, 0)], dtype=torch.int32, device=device).reshape(-1, 2)


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
    offsets: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton chunked forward; returns ``(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32)``."""
    _require_runnable(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    cu_list = offsets if offsets is not None else [b * T for b in range(B + 1)]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    chunks = _chunk_table(cu_list, dev)
    N, NC, NT = len(cu_list) - 1, chunks.shape[0], B * T
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    f32 = dict(dtype=torch.float32, device=dev)
    qn, kn, gc, w = (torch.empty(NT, H, K, **f32) for _ in range(4))
    u = torch.empty(NT, H, V, **f32)
    akk, aqk = torch.empty(NT, H, CHUNK, **f32), torch.empty(NT, H, CHUNK, **f32)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
    ht = torch.empty(N, H, K, V, **f32)
    BK, BVU = _block(K), _block(V)
    prec = _dot_precision(q.dtype)
    if NT > 0:
        _chunk_prep_kernel[(NC, H)](q, k, g, qn, kn, gc, chunks, scale, H, K,
                                    L2=use_qk_l2norm, EPS=L2_EPS, BT=CHUNK, BK=BK)
        _chunk_intra_kernel[(NC, H)](qn, kn, gc, akk, aqk, chunks, H, K,
                                     BT=CHUNK, BC=SUB_CHUNK, BK=BK, BKD=min(BK, 32), PREC=prec)
        _chunk_ut_kernel[(NC, H)](kn, gc, v, beta, akk, w, u, chunks, H, K, V,
                                  BT=CHUNK, BK=BK, BV=BVU, PREC=prec)
    BV = min(BVU, 64)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    _chunk_state_kernel[(N, H, triton.cdiv(V, BV))](
        qn, kn, gc, w, u, aqk, o, h0, ht, cu, H, K, V,
        HAS_H0=initial_state is not None, STORE_HT=True, BT=CHUNK, BK=BK, BV=BV, PREC=prec,
    )
    return o, ht


class ChunkKDAFunction(torch.autograd.Function):
    """Triton chunked forward; torch-backed backward (recompute with the torch path, then autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, use_qk_l2norm, offsets):
        o, ht = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, offsets)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.use_qk_l2norm, ctx.offsets = scale, use_qk_l2norm, offsets
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from kimi_vl.kernels.kda import chunk_kda_torch

        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[:6]
        with torch.enable_grad():
            inputs = [None if t is None else t.detach().requires_grad_(n) for t, n in zip(saved, needs, strict=True)]
            q, k, v, g, beta, h0 = inputs
            cu = None if ctx.offsets is None else torch.tensor(ctx.offsets, device=q.device)
            o, ht = chunk_kda_torch(q, k, v, g, beta, scale=ctx.scale, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm=ctx.use_qk_l2norm, cu_seqlens=cu)
            outs, grads_out = [], []
            for out, grad in ((o, do), (ht, dht)):
                if grad is not None:
                    outs.append(out)
                    grads_out.append(grad)
            wanted = [t for t in inputs if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(outs, wanted, grads_out, allow_unused=True) if wanted and outs else [])
        result = [next(grads) if t is not None and t.requires_grad else None for t in inputs]
        result = [torch.zeros_like(t) if r is None and t is not None and t.requires_grad else r
                  for r, t in zip(result, inputs, strict=True)]
        return (*result, None, None, None)


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    offsets: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA with the Triton forward (inputs already validated; ``offsets`` from ``_check``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, ht = ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, offsets)
    return o, ht if output_final_state else None
