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

* Backward (:func:`chunk_kda_bwd`, behind :class:`ChunkKDAFunction`): the forward kernels run again, keeping
  ``M``, the state entering each chunk and ``V_new`` (fp32), then five kernels:

  1. ``_chunk_bwd_state_kernel``: per (sequence, head, V block), the reverse pass over the chunks carrying
     ``dS``: stores each chunk's end-state gradient and ``dV_new = tril(A_qk)^T dO + (K exp(G_last - G)) dS``,
     and returns ``dS`` at the start as the initial state's gradient.
  2. ``_chunk_bwd_inter_kernel``: per (chunk, head), the terms that contract over V (``dO S^T``,
     ``dV_new S^T``, ``V_new dS'^T``, ``dO V_new^T``) as partial dq, dk, dG and dA_qk.
  3. ``_chunk_bwd_ut_kernel``: per (chunk, head), back through the UT transform (``dL = -M^T dM M^T``):
     dv, dbeta, dA_kk.
  4. ``_chunk_bwd_intra_kernel``: per (chunk, head), back through ``A_kk`` / ``A_qk`` with the forward's
     decay split (matmuls below the 16x16 block diagonal, one token at a time inside it).
  5. ``_chunk_bwd_final_kernel``: per (chunk, head), dG of the cumulative gate from ``x dx`` identities, the
     reverse in-chunk cumsum to dg, and back through the scale and the q/k L2 norm.

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

from kimi_vl.kernels.kda import CHUNK, GATE_FLOOR, L2_EPS, SUB_CHUNK

LOOP_STAGES = 1
"""Software-pipelining stages of the kernels that loop over chunks or value blocks (the state walks, the backward's
inter-chunk kernel). Each extra stage buffers another set of the loop's ``[BT, BK]`` tiles in shared memory: at
head dim 128 in bf16 the default 3 stages need 416-449 KiB, past every GPU's limit (227 KiB on H100 / H200,
163 KiB on A100); one stage needs 96-128 KiB. Each chunk's step waits on the state anyway."""


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
    if offsets is None:  # made on the device: a copy from a list would wait for the stream (each decode step)
        if T == 0:  # B empty sequences (arange's step cannot be 0)
            return torch.zeros(B + 1, dtype=torch.int32, device=device)
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


@triton.jit
def _state_tile(cu, state, H, K, V, HAS_STATE: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Prologue of the per-(sequence, head, V block) kernels: ``(i_n, i_h, bos, eos, rk, rv, mk, mv, m_s, s_off,
    S)`` with the sequence's token range, the ``[BK, BV]`` slice's masks and offsets in a ``[N, H, K, V]`` state,
    and the slice in fp32 (loaded from ``state`` when ``HAS_STATE``, else zeros)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    m_s = mk[:, None] & mv[None, :]
    s_off = ((i_n * H + i_h) * K + rk[:, None]).to(tl.int64) * V + rv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_STATE:
        S += tl.load(state + s_off, mask=m_s, other=0.0).to(tl.float32)
    return i_n, i_h, bos, eos, rk, rv, mk, mv, m_s, s_off, S


@triton.jit
def _chunk_rows(chunks):
    """Prologue of the per-(chunk, head) kernels: ``(i_c, i_h, bos, eos)``, the chunk's token range."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + 2 * i_c).to(tl.int64)
    eos = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    return i_c, i_h, bos, eos


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
    i_n, i_h, bos, eos, rk, rv, mk, mv, m_s, s_off, S = _state_tile(cu, h0, H, K, V, HAS_H0, BK, BV)
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
    """Forward-only recurrent KDA (no autograd); inputs already validated (``_check``). The sequence offsets are
    ``cu_seqlens`` as it is when given (the kernel reads them on the device), else the host list ``offsets``, else
    one sequence per batch row."""
    _require_runnable(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    else:
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
    i_c, i_h, bos, eos = _chunk_rows(chunks)
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
    i_c, i_h, bos, eos = _chunk_rows(chunks)
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
    kn, gc, v, beta, akk, w, u, mm, chunks,
    H, K, V,
    STORE_M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_h, bos, eos = _chunk_rows(chunks)
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
    if STORE_M:
        tl.store(mm + (rt[:, None] * H + i_h) * BT + r[None, :], M, mask=mt[:, None])
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
    qn, kn, gc, w, u, aqk, o, h0, ht, hs, vn, cu, chunk_first,
    H, K, V,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_n, i_h, bos, eos, rk, rv, mk, mv, m_s, s_off, S = _state_tile(cu, h0, H, K, V, HAS_H0, BK, BV)
    r = tl.arange(0, BT)
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
        if STORE_H:  # for the backward: the state entering this chunk, and v_new
            ci = tl.load(chunk_first + i_n).to(tl.int64) + (cs - bos) // BT
            tl.store(hs + ((ci * H + i_h) * K + rk[:, None]) * V + rv[None, :], S, mask=m_s)
            tl.store(vn + off_v, v_new, mask=m_v)
        b_o = tl.dot(b_q * tl.exp(b_g), S, input_precision=PREC) + tl.dot(b_a, v_new, input_precision=PREC)
        tl.store(o + off_v, b_o.to(o.dtype.element_ty), mask=m_v)
        b_kg = b_k * tl.exp(tl.where(m_k, g_last[None, :] - b_g, float("-inf")))
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(b_kg), v_new, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + s_off, S, mask=m_s)


# ----------------------------------------------------------------------------------------------------------
# Chunked backward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_bwd_state_kernel(
    qn, kn, gc, w, aqk, do, dht, dh, dvn, dh0, cu, chunk_first,
    H, K, V,
    HAS_DHT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse pass over one sequence's chunks: the gradient of every chunk's end state (``dh``), ``dv_new``
    and the initial state's gradient. V columns of the state are independent, so V is split across programs."""
    i_n, i_h, bos, eos, rk, rv, mk, mv, m_s, s_off, dS = _state_tile(cu, dht, H, K, V, HAS_DHT, BK, BV)
    first = tl.load(chunk_first + i_n).to(tl.int64)
    r = tl.arange(0, BT)
    upper = r[:, None] <= r[None, :]  # A_qk^T is upper triangular
    n_chunks = (eos - bos + BT - 1) // BT
    for c_rev in range(0, n_chunks):
        c = n_chunks - 1 - c_rev
        cs = bos + c * BT
        rt = cs + r
        mt = rt < eos
        m_k = mt[:, None] & mk[None, :]
        m_v = mt[:, None] & mv[None, :]
        off_k = (rt[:, None] * H + i_h) * K + rk[None, :]
        off_v = (rt[:, None] * H + i_h) * V + rv[None, :]
        tl.store(dh + (((first + c) * H + i_h) * K + rk[:, None]) * V + rv[None, :], dS, mask=m_s)
        b_q = tl.load(qn + off_k, mask=m_k, other=0.0)
        b_k = tl.load(kn + off_k, mask=m_k, other=0.0)
        b_g = tl.load(gc + off_k, mask=m_k, other=0.0)
        b_w = tl.load(w + off_k, mask=m_k, other=0.0)
        last = tl.minimum(cs + BT, eos) - 1
        g_last = tl.load(gc + (last * H + i_h) * K + rk, mask=mk, other=0.0)
        b_do = tl.load(do + off_v, mask=m_v, other=0.0).to(tl.float32)
        b_at = tl.load(aqk + (rt[None, :] * H + i_h) * BT + r[:, None], mask=mt[None, :], other=0.0)
        b_at = tl.where(upper, b_at, 0.0)
        b_kd = b_k * tl.exp(tl.where(m_k, g_last[None, :] - b_g, float("-inf")))
        b_dv = tl.dot(b_at, b_do, input_precision=PREC) + tl.dot(b_kd, dS, input_precision=PREC)
        tl.store(dvn + off_v, b_dv, mask=m_v)
        dS = (dS * tl.exp(g_last)[:, None] + tl.dot(tl.trans(b_q * tl.exp(b_g)), b_do, input_precision=PREC)
              - tl.dot(tl.trans(b_w), b_dv, input_precision=PREC))
    tl.store(dh0 + s_off, dS, mask=m_s)


@triton.jit
def _chunk_bwd_inter_kernel(
    qn, kn, gc, hs, dh, vn, do, dvn, dqn, dkn, dgc, dgl, daqk, dw, chunks,
    H, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head), from the chunk's start state S and end-state gradient dS': the gradients of
    ``Q exp(G)``, ``W``, ``K exp(G_last - G)``, ``exp(G_last)`` and ``A_qk`` (all contract over V), turned into
    partial dq, dk, dG (of the cumulative gate) and dG_last."""
    i_c, i_h, bos, eos = _chunk_rows(chunks)
    r = tl.arange(0, BT)
    rt = bos + r
    mt = rt < eos
    rk = tl.arange(0, BK)
    mk = rk < K
    m_k = mt[:, None] & mk[None, :]
    off_k = (rt[:, None] * H + i_h) * K + rk[None, :]
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)
    for vs in range(0, V, BV):
        rv = vs + tl.arange(0, BV)
        mv = rv < V
        m_v = mt[:, None] & mv[None, :]
        m_s = mk[:, None] & mv[None, :]
        h_off = ((i_c * H + i_h) * K + rk[:, None]).to(tl.int64) * V + rv[None, :]
        b_h = tl.load(hs + h_off, mask=m_s, other=0.0)
        b_dh = tl.load(dh + h_off, mask=m_s, other=0.0)
        off_v = (rt[:, None] * H + i_h) * V + rv[None, :]
        b_vn = tl.load(vn + off_v, mask=m_v, other=0.0)
        b_do = tl.load(do + off_v, mask=m_v, other=0.0).to(tl.float32)
        b_dv = tl.load(dvn + off_v, mask=m_v, other=0.0)
        b_dqg += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dw -= tl.dot(b_dv, tl.trans(b_h), input_precision=PREC)
        b_dkd += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        b_da += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dgl += tl.sum(b_h * b_dh, 1)
    b_q = tl.load(qn + off_k, mask=m_k, other=0.0)
    b_k = tl.load(kn + off_k, mask=m_k, other=0.0)
    b_g = tl.load(gc + off_k, mask=m_k, other=0.0)
    g_last = tl.load(gc + ((eos - 1) * H + i_h) * K + rk, mask=mk, other=0.0)
    b_qg = b_q * tl.exp(b_g)
    to_end = tl.exp(tl.where(m_k, g_last[None, :] - b_g, float("-inf")))
    b_kd = b_k * to_end
    tl.store(dqn + off_k, b_dqg * tl.exp(b_g), mask=m_k)
    tl.store(dkn + off_k, b_dkd * to_end, mask=m_k)
    tl.store(dgc + off_k, b_dqg * b_qg - b_dkd * b_kd, mask=m_k)
    tl.store(dw + off_k, b_dw, mask=m_k)
    tl.store(dgl + (i_c * H + i_h) * K + rk, b_dgl * tl.exp(g_last) + tl.sum(b_dkd * b_kd, 0), mask=mk)
    causal = r[:, None] >= r[None, :]
    tl.store(daqk + (rt[:, None] * H + i_h) * BT + r[None, :], tl.where(causal, b_da, 0.0), mask=mt[:, None])


@triton.jit
def _chunk_bwd_ut_kernel(
    kn, gc, v, beta, akk, mm, dw, dvn, dkn, dgc, dv, dbeta, dakk, chunks,
    H, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head): back through ``W = M diag(beta) exp(G) K`` and ``U = M diag(beta) V`` with
    ``M = (I + tril(diag(beta) A_kk, -1))^-1`` (so ``dL = -M^T dM M^T``): final dv and dbeta, dA_kk, and the
    W terms added to the partial dk and dG."""
    i_c, i_h, bos, eos = _chunk_rows(chunks)
    r = tl.arange(0, BT)
    rt = bos + r
    mt = rt < eos
    b_beta = tl.load(beta + rt * H + i_h, mask=mt, other=0.0).to(tl.float32)
    a_off = (rt[:, None] * H + i_h) * BT + r[None, :]
    b_m = tl.load(mm + a_off, mask=mt[:, None], other=0.0)
    b_akk = tl.load(akk + a_off, mask=mt[:, None], other=0.0)
    rk = tl.arange(0, BK)
    m_k = mt[:, None] & (rk < K)[None, :]
    off_k = (rt[:, None] * H + i_h) * K + rk[None, :]
    b_eg = tl.exp(tl.load(gc + off_k, mask=m_k, other=0.0))
    b_kg = tl.load(kn + off_k, mask=m_k, other=0.0) * b_eg
    b_dw = tl.load(dw + off_k, mask=m_k, other=0.0)
    rv = tl.arange(0, BV)
    m_v = mt[:, None] & (rv < V)[None, :]
    off_v = (rt[:, None] * H + i_h) * V + rv[None, :]
    b_v = tl.load(v + off_v, mask=m_v, other=0.0).to(tl.float32)
    b_du = tl.load(dvn + off_v, mask=m_v, other=0.0)
    b_mt = tl.trans(b_m)
    b_dbk = tl.dot(b_mt, b_dw, input_precision=PREC)
    b_dbv = tl.dot(b_mt, b_du, input_precision=PREC)
    b_dm = (tl.dot(b_dw, tl.trans(b_kg * b_beta[:, None]), input_precision=PREC)
            + tl.dot(b_du, tl.trans(b_v * b_beta[:, None]), input_precision=PREC))
    b_dl = -tl.dot(tl.dot(b_mt, b_dm, input_precision=PREC), b_mt, input_precision=PREC)
    b_dl = tl.where(r[:, None] > r[None, :], b_dl, 0.0)
    b_db = tl.sum(b_dl * b_akk, 1) + tl.sum(b_dbk * b_kg, 1) + tl.sum(b_dbv * b_v, 1)
    tl.store(dbeta + rt * H + i_h, b_db.to(dbeta.dtype.element_ty), mask=mt)
    tl.store(dakk + a_off, b_dl * b_beta[:, None], mask=mt[:, None])
    tl.store(dv + off_v, (b_dbv * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_v)
    b_dkg = b_dbk * b_beta[:, None]
    tl.store(dkn + off_k, tl.load(dkn + off_k, mask=m_k, other=0.0) + b_dkg * b_eg, mask=m_k)
    tl.store(dgc + off_k, tl.load(dgc + off_k, mask=m_k, other=0.0) + b_dkg * b_kg, mask=m_k)


@triton.jit
def _chunk_bwd_intra_kernel(
    qn, kn, gc, dakk, daqk, xq, xkr, xkc, chunks,
    H, K,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head): back through ``A_kk`` / ``A_qk``. Writes dq (``xq``), the row-side dk (``xkr``,
    from k_i in ``A_kk[i, j]``) and the column-side dk (``xkc``, from k_j); the gate gradient follows from
    them in the final kernel as ``q xq + k xkr - k xkc``. Same decay split as the forward: matmuls with the
    factors ``e^{G_i - G_n}``, ``e^{G_n - G_j}`` below the block diagonal, one token at a time inside it."""
    i_c, i_h, bos, eos = _chunk_rows(chunks)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    mk = rk < K
    for i in tl.static_range(BT // BC):  # row sub-chunks: dq and the row-side dk
        ri = bos + i * BC + rc
        mi_t = ri < eos
        mi = mi_t[:, None] & mk[None, :]
        off_i = (ri[:, None] * H + i_h) * K + rk[None, :]
        b_gi = tl.load(gc + off_i, mask=mi, other=0.0)
        b_dq = tl.zeros([BC, BK], dtype=tl.float32)
        b_dkr = tl.zeros([BC, BK], dtype=tl.float32)
        if i > 0:
            n = bos + i * BC
            g_ref = tl.load(gc + (n * H + i_h) * K + rk, mask=mk & (n < eos), other=0.0)
            for j in tl.static_range(i):
                rj = bos + j * BC + rc
                mj = (rj < eos)[:, None] & mk[None, :]
                off_j = (rj[:, None] * H + i_h) * K + rk[None, :]
                b_gj = tl.load(gc + off_j, mask=mj, other=0.0)
                b_kc = tl.load(kn + off_j, mask=mj, other=0.0) * tl.exp(
                    tl.where(mj & (n < eos), g_ref[None, :] - b_gj, 0.0))
                a_off = (ri[:, None] * H + i_h) * BT + j * BC + rc[None, :]
                b_dq += tl.dot(tl.load(daqk + a_off, mask=mi_t[:, None], other=0.0), b_kc, input_precision=PREC)
                b_dkr += tl.dot(tl.load(dakk + a_off, mask=mi_t[:, None], other=0.0), b_kc, input_precision=PREC)
            row_decay = tl.exp(tl.where(mi, b_gi - g_ref[None, :], 0.0))
            b_dq *= row_decay
            b_dkr *= row_decay
        for b in range(BC):  # diagonal sub-block, column token b
            tb = bos + i * BC + b
            m_b = mk & (tb < eos)
            k_b = tl.load(kn + (tb * H + i_h) * K + rk, mask=m_b, other=0.0)
            g_b = tl.load(gc + (tb * H + i_h) * K + rk, mask=m_b, other=0.0)
            col = (ri * H + i_h) * BT + i * BC + b
            d_qk = tl.load(daqk + col, mask=mi_t, other=0.0)
            d_kk = tl.load(dakk + col, mask=mi_t, other=0.0)
            keep = (rc[:, None] >= b) & mi & (tb < eos)
            ke = k_b[None, :] * tl.exp(tl.where(keep, b_gi - g_b[None, :], float("-inf")))
            b_dq += d_qk[:, None] * ke
            b_dkr += d_kk[:, None] * ke
        tl.store(xq + off_i, b_dq, mask=mi)
        tl.store(xkr + off_i, b_dkr, mask=mi)
    for j in tl.static_range(BT // BC):  # column sub-chunks: the column-side dk
        rj = bos + j * BC + rc
        mj_t = rj < eos
        mj = mj_t[:, None] & mk[None, :]
        off_j = (rj[:, None] * H + i_h) * K + rk[None, :]
        b_gj = tl.load(gc + off_j, mask=mj, other=0.0)
        b_dkc = tl.zeros([BC, BK], dtype=tl.float32)
        for i in tl.static_range(j + 1, BT // BC):
            n = bos + i * BC
            g_ref = tl.load(gc + (n * H + i_h) * K + rk, mask=mk & (n < eos), other=0.0)
            ri = bos + i * BC + rc
            mi_t = ri < eos
            mi = mi_t[:, None] & mk[None, :]
            off_i = (ri[:, None] * H + i_h) * K + rk[None, :]
            row_decay = tl.exp(tl.where(mi, tl.load(gc + off_i, mask=mi, other=0.0) - g_ref[None, :], 0.0))
            b_kr = tl.load(kn + off_i, mask=mi, other=0.0) * row_decay
            b_qr = tl.load(qn + off_i, mask=mi, other=0.0) * row_decay
            a_off = (ri[:, None] * H + i_h) * BT + j * BC + rc[None, :]
            d_kk = tl.load(dakk + a_off, mask=mi_t[:, None], other=0.0)
            d_qk = tl.load(daqk + a_off, mask=mi_t[:, None], other=0.0)
            col_decay = tl.exp(tl.where(mj & (n < eos), g_ref[None, :] - b_gj, 0.0))
            b_dkc += (tl.dot(tl.trans(d_kk), b_kr, input_precision=PREC)
                      + tl.dot(tl.trans(d_qk), b_qr, input_precision=PREC)) * col_decay
        # names new to this dynamic loop: one that exists already (a tile of the loops above) would be
        # loop-carried, and must keep its shape
        for a in range(BC):  # diagonal sub-block, row token a
            ta = bos + j * BC + a
            m_a = mk & (ta < eos)
            tok_a = (ta * H + i_h) * K + rk
            k_a = tl.load(kn + tok_a, mask=m_a, other=0.0)
            q_a = tl.load(qn + tok_a, mask=m_a, other=0.0)
            g_a = tl.load(gc + tok_a, mask=m_a, other=0.0)
            row = (ta * H + i_h) * BT + j * BC + rc
            dkk_a = tl.load(dakk + row, mask=ta < eos, other=0.0)
            dqk_a = tl.load(daqk + row, mask=ta < eos, other=0.0)
            keep = (rc[:, None] <= a) & mj & (ta < eos)
            e = tl.exp(tl.where(keep, g_a[None, :] - b_gj, float("-inf")))
            b_dkc += (dkk_a[:, None] * k_a[None, :] + dqk_a[:, None] * q_a[None, :]) * e
        tl.store(xkc + off_j, b_dkc, mask=mj)


@triton.jit
def _chunk_bwd_final_kernel(
    q, k, qn, kn, dqn, dkn, dgc, dgl, xq, xkr, xkc, dq, dk, dg, chunks, scale,
    H, K,
    L2: tl.constexpr, EPS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    """Per (chunk, head): sum the partial gradients, turn dG (cumulative gate) into dg by a reverse in-chunk
    cumsum (G_last's gradient lands on the last token), and back through the scale and the q/k L2 norm."""
    i_c, i_h, bos, eos = _chunk_rows(chunks)
    rt = bos + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    m = (rt < eos)[:, None] & (rk < K)[None, :]
    off = (rt[:, None] * H + i_h) * K + rk[None, :]
    b_xq = tl.load(xq + off, mask=m, other=0.0)
    b_xkr = tl.load(xkr + off, mask=m, other=0.0)
    b_xkc = tl.load(xkc + off, mask=m, other=0.0)
    b_dq = tl.load(dqn + off, mask=m, other=0.0) + b_xq
    b_dk = tl.load(dkn + off, mask=m, other=0.0) + b_xkr + b_xkc
    b_dG = (tl.load(dgc + off, mask=m, other=0.0) + tl.load(qn + off, mask=m, other=0.0) * b_xq
            + tl.load(kn + off, mask=m, other=0.0) * (b_xkr - b_xkc))
    b_dgl = tl.load(dgl + (i_c * H + i_h) * K + rk, mask=rk < K, other=0.0)
    b_dG = tl.where((rt == eos - 1)[:, None], b_dG + b_dgl[None, :], b_dG)
    b_dg = b_dG - tl.cumsum(b_dG, 0) + tl.sum(b_dG, 0)[None, :]
    tl.store(dg + off, b_dg.to(dg.dtype.element_ty), mask=m)
    b_dq = b_dq * scale
    if L2:
        b_q = tl.load(q + off, mask=m, other=0.0).to(tl.float32)
        b_k = tl.load(k + off, mask=m, other=0.0).to(tl.float32)
        r_q = tl.rsqrt(tl.sum(b_q * b_q, 1) + EPS)
        r_k = tl.rsqrt(tl.sum(b_k * b_k, 1) + EPS)
        q_hat = b_q * r_q[:, None]
        k_hat = b_k * r_k[:, None]
        b_dq = (b_dq - q_hat * tl.sum(q_hat * b_dq, 1)[:, None]) * r_q[:, None]
        b_dk = (b_dk - k_hat * tl.sum(k_hat * b_dk, 1)[:, None]) * r_k[:, None]
    tl.store(dq + off, b_dq.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + off, b_dk.to(dk.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


_layouts: list[tuple[list[int], torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []


def _chunk_layout(cu_list: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu [N+1], chunks [n_chunks, 2], chunk_first [N])`` int32 on ``device``: the sequence offsets, the (first
    token, end token) of every chunk of every packed sequence, and the index of each sequence's first chunk in that
    table. Copying them from the host waits for the stream, so the last two layouts are kept, keyed on the list
    object itself: the layers of one forward share the list (``host_offsets``) and copy it once."""
    for key, dev, layout in _layouts:
        if key is cu_list and dev == device:
            return layout
    rows, first = [], []
    for a, b in pairwise(cu_list):
        first.append(len(rows))
        rows += [(s, min(s + CHUNK, b)) for s in range(a, b, CHUNK)]

    def aligned(values: list[int]) -> list[int]:  # each part starts on 16 bytes, as Triton's pointers specialise
        return values + [0] * (-len(values) % 4)

    cu_part, first_part = aligned(list(cu_list)), aligned(first)
    table = [x for row in rows or [(0, 0)] for x in row]
    packed = torch.tensor(cu_part + first_part + table, dtype=torch.int32, device=device)  # one copy for the three
    a, b = len(cu_part), len(cu_part) + len(first_part)
    layout = (packed[: len(cu_list)], packed[b:].view(-1, 2), packed[a : a + len(first)])
    _layouts.append((cu_list, device, layout))
    del _layouts[:-2]
    return layout


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
    for_backward: bool = False,
) -> dict[str, torch.Tensor]:
    """Run the four forward kernels; returns ``o`` ``[B, T, H, V]`` (q's dtype), ``ht`` ``[N, H, K, V]`` fp32 and,
    with ``for_backward``, the fp32 intermediates the backward kernels read (per-token rows ``[B*T, H, *]``,
    per-chunk start states ``hs`` ``[n_chunks, H, K, V]``)."""
    _require_runnable(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    cu_list = offsets if offsets is not None else [b * T for b in range(B + 1)]
    cu, chunks, chunk_first = _chunk_layout(cu_list, dev)
    N, NC, NT = len(cu_list) - 1, chunks.shape[0], B * T
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    f32 = dict(dtype=torch.float32, device=dev)
    qn, kn, gc, w = (torch.empty(NT, H, K, **f32) for _ in range(4))
    u = torch.empty(NT, H, V, **f32)
    akk, aqk = torch.empty(NT, H, CHUNK, **f32), torch.empty(NT, H, CHUNK, **f32)
    mm = torch.empty(NT, H, CHUNK, **f32) if for_backward else akk
    hs = torch.empty(NC, H, K, V, **f32) if for_backward else u
    vn = torch.empty(NT, H, V, **f32) if for_backward else u
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
    ht = torch.empty(N, H, K, V, **f32)
    BK, BVU = _block(K), _block(V)
    prec = _dot_precision(q.dtype)
    if NT > 0:
        _chunk_prep_kernel[(NC, H)](q, k, g, qn, kn, gc, chunks, scale, H, K,
                                    L2=use_qk_l2norm, EPS=L2_EPS, BT=CHUNK, BK=BK)
        _chunk_intra_kernel[(NC, H)](qn, kn, gc, akk, aqk, chunks, H, K,
                                     BT=CHUNK, BC=SUB_CHUNK, BK=BK, BKD=min(BK, 32), PREC=prec)
        _chunk_ut_kernel[(NC, H)](kn, gc, v, beta, akk, w, u, mm, chunks, H, K, V,
                                  STORE_M=for_backward, BT=CHUNK, BK=BK, BV=BVU, PREC=prec)
    BV = min(BVU, 64)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    _chunk_state_kernel[(N, H, triton.cdiv(V, BV))](
        qn, kn, gc, w, u, aqk, o, h0, ht, hs, vn, cu, chunk_first, H, K, V,
        HAS_H0=initial_state is not None, STORE_HT=True, STORE_H=for_backward, BT=CHUNK, BK=BK, BV=BV, PREC=prec,
        num_stages=LOOP_STAGES,
    )
    out = dict(o=o, ht=ht)
    if for_backward:
        out.update(qn=qn, kn=kn, gc=gc, w=w, akk=akk, aqk=aqk, mm=mm, hs=hs, vn=vn, cu=cu, chunks=chunks,
                   chunk_first=chunk_first)
    return out


def chunk_kda_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
    offsets: list[int] | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Triton chunked backward (recomputes the forward intermediates); returns ``dq, dk, dv, dg, dbeta`` in the
    inputs' dtypes and ``dh0`` ``[N, H, K, V]`` fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    fw = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, offsets, for_backward=True)
    N, NC, NT = fw["cu"].numel() - 1, fw["chunks"].shape[0], B * T
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    f32 = dict(dtype=torch.float32, device=dev)
    dh = torch.empty(NC, H, K, V, **f32)
    dvn = torch.empty(NT, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32)
    BK, BVU = _block(K), _block(V)
    BV = min(BVU, 64)
    prec = _dot_precision(q.dtype)
    dht_arg = dht.contiguous() if dht is not None else dh0
    _chunk_bwd_state_kernel[(N, H, triton.cdiv(V, BV))](
        fw["qn"], fw["kn"], fw["gc"], fw["w"], fw["aqk"], do, dht_arg, dh, dvn, dh0, fw["cu"], fw["chunk_first"],
        H, K, V, HAS_DHT=dht is not None, BT=CHUNK, BK=BK, BV=BV, PREC=prec, num_stages=LOOP_STAGES,
    )
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g, memory_format=torch.contiguous_format)
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    if NT > 0:
        dqn, dkn, dgc, dw, xq, xkr, xkc = (torch.empty(NT, H, K, **f32) for _ in range(7))
        daqk, dakk = torch.empty(NT, H, CHUNK, **f32), torch.empty(NT, H, CHUNK, **f32)
        dgl = torch.empty(NC, H, K, **f32)
        chunks = fw["chunks"]
        _chunk_bwd_inter_kernel[(NC, H)](
            fw["qn"], fw["kn"], fw["gc"], fw["hs"], dh, fw["vn"], do, dvn, dqn, dkn, dgc, dgl, daqk, dw, chunks,
            H, K, V, BT=CHUNK, BK=BK, BV=BV, PREC=prec, num_stages=LOOP_STAGES,
        )
        _chunk_bwd_ut_kernel[(NC, H)](
            fw["kn"], fw["gc"], v, beta, fw["akk"], fw["mm"], dw, dvn, dkn, dgc, dv, dbeta, dakk, chunks,
            H, K, V, BT=CHUNK, BK=BK, BV=BVU, PREC=prec,
        )
        _chunk_bwd_intra_kernel[(NC, H)](
            fw["qn"], fw["kn"], fw["gc"], dakk, daqk, xq, xkr, xkc, chunks, H, K,
            BT=CHUNK, BC=SUB_CHUNK, BK=BK, PREC=prec,
        )
        _chunk_bwd_final_kernel[(NC, H)](
            q, k, fw["qn"], fw["kn"], dqn, dkn, dgc, dgl, xq, xkr, xkc, dq, dk, dg, chunks, scale, H, K,
            L2=use_qk_l2norm, EPS=L2_EPS, BT=CHUNK, BK=BK,
        )
    return dq, dk, dv, dg, dbeta, dh0


class ChunkKDAFunction(torch.autograd.Function):
    """Triton chunked KDA: forward kernels, and backward kernels that recompute the forward's intermediates."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, use_qk_l2norm, offsets):
        out = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, offsets)
        o, ht = out["o"], out["ht"]
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.use_qk_l2norm, ctx.offsets = scale, use_qk_l2norm, offsets
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(q, k, v, g, beta, ctx.scale, h0, ctx.use_qk_l2norm,
                                                   ctx.offsets, do, dht)
        return dq, dk, dv, dg, dbeta, None if h0 is None else dh0.to(h0.dtype), None, None, None


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
    """Chunked KDA with the Triton forward and backward (inputs already validated; ``offsets`` from ``_check``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = g.clamp_min(GATE_FLOOR)
    o, ht = ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, offsets)
    return o, ht if output_final_state else None
