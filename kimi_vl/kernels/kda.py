"""Kimi Delta Attention (KDA) ops in plain PyTorch.

Layout: q, k, g are ``[B, T, H, Dk]``, v is ``[B, T, H, Dv]``, beta is ``[B, T, H]`` and the recurrent
state is ``[N, H, Dk, Dv]`` (rows = key channels). Per head and token the recurrence is (decay *before*
the delta correction)::

    S <- S * exp(g_t)[:, None]
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

Four implementations share this contract:

* :func:`naive_recurrent_kda` - the readable token-by-token reference (works in float64).
* :func:`naive_chunk_kda` - the readable chunked reference: the WY/UT algebra of the fast path, one chunk at a time.
* :func:`fused_recurrent_kda` - a lean token loop vectorised over batch and heads, for decoding.
* :func:`chunk_kda` - the chunked WY/UT-transform algorithm (sub-chunk 16; chunk 64 in the Triton kernels, 32 in
  the torch path) for prefill/training.

All compute in float32 (float64 inputs stay float64), return ``o`` in the dtype of ``q`` and the final
state in the compute dtype; :func:`chunk_kda` and :func:`fused_recurrent_kda` switch autocast off around the torch
paths (a bf16 autocast region, as in mixed-precision training, would otherwise run their matmuls in bf16).

Dispatch of :func:`chunk_kda` and :func:`fused_recurrent_kda`: CUDA tensors use the Triton kernels
(:mod:`kimi_vl.kernels.kda_triton`), CPU tensors the torch paths (:func:`chunk_kda_torch`,
:func:`fused_recurrent_kda_torch`). ``KIMI_VL_KERNELS=reference|torch|triton`` forces a path: ``reference``
is the naive token loop; ``triton`` on CPU runs the kernels through the Triton interpreter (needs
``TRITON_INTERPRET=1`` before triton is imported). The Triton path falls back to torch for float64 inputs,
and ``fused_recurrent_kda`` (forward-only kernel) also when an input requires grad.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from itertools import accumulate, pairwise

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kimi_vl.errors import ConfigError, ShapeError
from kimi_vl.kernels.autocast import autocast_off
from kimi_vl.kernels.offsets import host_offsets

# Shared by the torch and Triton paths (kda_triton imports them): chunk and sub-chunk lengths of the chunked
# algorithm, and the eps added to the sum of squares by the in-kernel q/k L2 norm.
CHUNK = 64
SUB_CHUNK = 16
L2_EPS = 1e-6
# The chunked paths clamp the log decay g from below at log(fp32 tiny) = -87.3: below it exp(g) is under every normal
# fp32 number (a decay of practically 0), while in-chunk cumulative sums G, whose differences give every decay, would
# lose the other tokens' gates to cancellation (an fp32 G near -1e4 has a spacing of 1e-3) or make -inf - -inf NaN.
GATE_FLOOR = math.log(torch.finfo(torch.float32).tiny)
# The torch path's chunk: each packed sequence is padded to whole chunks, and packed training documents are short
# (about 70 tokens in the tiny preset's pre-training), so at 64 a third of the chunk work was padding; at 32 a
# pre-training step takes 0.87-0.93x the time, and a dense 4096-token sequence the same time (`bench/kda.py`).
TORCH_CHUNK = 32

_Out = tuple[torch.Tensor, torch.Tensor | None]


BACKENDS = ("reference", "torch", "triton")


def _backend(x: torch.Tensor) -> str:
    """The KDA path for tensors like ``x``: ``KIMI_VL_KERNELS`` if set, else triton on CUDA and torch on CPU."""
    mode = os.environ.get("KIMI_VL_KERNELS", "").strip().lower()
    if mode in ("", "auto"):
        return "triton" if x.is_cuda else "torch"
    if mode not in BACKENDS:
        raise ConfigError(f"KIMI_VL_KERNELS must be one of {BACKENDS} (or unset), got {mode!r}")
    return mode


def _triton_ok(*tensors: torch.Tensor | None, grad_ok: bool = True) -> bool:
    """Whether the Triton kernels can serve these inputs (not float64; no grad for forward-only kernels)."""
    ts = [t for t in tensors if t is not None]
    if any(t.dtype == torch.float64 for t in ts):
        return False
    return grad_ok or not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32 (float64 kept); same shape/dtype as x."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> list[int] | None:
    """Validate shapes; return the cu_seqlens offsets as a Python list (None without varlen)."""
    if q.dim() != 4:
        raise ShapeError(f"q must be [B, T, H, Dk], got {_shape(q)}")
    B, T, H, Dk = q.shape
    for name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ShapeError(f"{name} {_shape(t)} must have the shape of q {_shape(q)} ([B, T, H, Dk])")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ShapeError(f"v {_shape(v)} must be [B, T, H, Dv] with B, T, H of q {_shape(q)}")
    if beta.shape != q.shape[:3]:
        raise ShapeError(f"beta {_shape(beta)} must be [B, T, H] = {_shape(q)[:3]}")
    n_seq, offsets = B, None
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ShapeError(f"cu_seqlens must be 1-D offsets [N+1], got {_shape(cu_seqlens)}")
        if B != 1:
            raise ShapeError(f"cu_seqlens needs batch size 1 (sequences packed along T), got q {_shape(q)}")
        offsets = host_offsets(cu_seqlens)
        if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in pairwise(offsets)):
            raise ShapeError(f"cu_seqlens {offsets} must rise from 0 to T={T}")
        n_seq = len(offsets) - 1
    want = (n_seq, H, Dk, v.shape[-1])
    if initial_state is not None and _shape(initial_state) != want:
        raise ShapeError(f"initial_state {_shape(initial_state)} must be [N, H, Dk, Dv] = {want}")
    return offsets


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """Cast to the compute dtype, optionally L2-normalise q/k, and fold ``scale`` into q."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    h0 = None if initial_state is None else initial_state.to(dtype)
    return q, k, v, g, beta, h0


_Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _walk_blocks(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
                 block: int, step: _Step) -> _Out:
    """The loop of the two references (contract of :func:`naive_recurrent_kda`): validate and prepare the inputs,
    then walk each independent run (the whole batch, or one packed sequence at a time) in blocks of ``block``
    tokens (the last one shorter), ``o, S = step(q, k, v, g, beta, S)`` advancing the state ``S [N, H, Dk, Dv]``
    over one block of inputs ``[N, L, H, *]`` (beta ``[N, L, H]``) and returning its output ``o [N, L, H, Dv]``."""
    offsets = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta, h0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    # (token range, state rows) of each independent run.
    runs = [(0, T, 0, B)] if offsets is None else [(a, b, i, i + 1) for i, (a, b) in enumerate(pairwise(offsets))]
    outputs, finals = [], []
    for start, end, s0, s1 in runs:
        S = q.new_zeros(s1 - s0, H, Dk, Dv) if h0 is None else h0[s0:s1]
        for a in range(start, end, block):
            b = min(a + block, end)
            o, S = step(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], S)
            outputs.append(o)
        finals.append(S)
    o = torch.cat(outputs, 1) if outputs else v.new_zeros(B, 0, H, Dv)
    return o.to(out_dtype), torch.cat(finals) if output_final_state else None


def naive_recurrent_kda(
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
) -> _Out:
    """Reference KDA: one token at a time, exactly the recurrence in the module docstring.

    Args: q, k, g ``[B, T, H, Dk]``; v ``[B, T, H, Dv]``; beta ``[B, T, H]``; initial_state
    ``[N, H, Dk, Dv]`` (N = B, or the number of sequences with ``cu_seqlens`` ``[N+1]``, which needs B = 1).
    Returns ``(o [B, T, H, Dv] in q's dtype, final_state [N, H, Dk, Dv] or None)``.
    """
    return _walk_blocks(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
                        1, _naive_token_step)


def _naive_token_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k, g ``[N, 1, H, Dk]`` (q scaled), v ``[N, 1, H, Dv]``, beta ``[N, 1, H]``, state S
    ``[N, H, Dk, Dv]``. Returns ``(o [N, 1, H, Dv], next S)``: the recurrence of the module docstring."""
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
    S = S * g.exp()[..., None]
    prediction = (S * k[..., None]).sum(-2)
    delta = beta[..., None] * (v - prediction)
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2)[:, None], S


def naive_chunk_kda(
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
) -> _Out:
    """Reference chunked KDA: the WY/UT algebra of :func:`chunk_kda` written plainly, one chunk at a time.

    Same contract as :func:`chunk_kda` (and :func:`naive_recurrent_kda`, which it equals up to rounding):
    q, k, g ``[B, T, H, Dk]``; v ``[B, T, H, Dv]``; beta ``[B, T, H]``; initial_state ``[N, H, Dk, Dv]``;
    cu_seqlens ``[N+1]`` (B = 1). Returns ``(o [B, T, H, Dv] in q's dtype, final_state [N, H, Dk, Dv] or None)``.
    Each sequence is cut into chunks of ``CHUNK`` tokens (the last one shorter, no padding); every chunk is one
    call of :func:`_naive_chunk_step`. Readable and differentiable, not fast: for tests and for reading.
    """
    return _walk_blocks(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
                        CHUNK, _naive_chunk_step)


def _naive_chunk_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens: q, k, g ``[N, L, H, Dk]`` (q scaled), v ``[N, L, H, Dv]``, beta ``[N, L, H]``, and
    the state entering the chunk S ``[N, H, Dk, Dv]``. Returns ``(o [N, L, H, Dv], state leaving the chunk)``.

    With ``G`` the in-chunk cumulative log decay and ``Γ = exp(G)``, unrolling the recurrence over the chunk gives
    the state after token i as ``Γ_i S + sum_{j<=i} (k_j Γ_i / Γ_j) u_j^T``, where ``u_j`` is token j's delta
    ``beta_j (v_j - prediction_j)``. The predictions read S and the earlier deltas, so the deltas solve the unit
    lower-triangular system ``(I + A_kk) U_new = diag(beta) (V - (K Γ) S)``: the UT transform.
    """
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))  # [N, H, L, D]: one chunk per (sequence, head)
    beta = beta.transpose(1, 2)  # [N, H, L]
    L = q.shape[-2]
    G = g.cumsum(-2)  # [N, H, L, Dk], non-increasing along L

    # decay[i, j, d] = Γ_id / Γ_jd = exp(G_id - G_jd) for j <= i, else 0 (masked before the exp: would overflow).
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()

    # A_kk[i, j] = beta_i k_i . (k_j Γ_i / Γ_j) for j < i: how token j's delta enters token i's prediction.
    A_kk = torch.einsum("nhid,nhjd,nhijd->nhij", k, k, decay).tril(-1) * beta[..., :, None]
    # A_qk[i, j] = q_i . (k_j Γ_i / Γ_j) for j <= i: how token j's delta enters token i's output.
    A_qk = torch.einsum("nhid,nhjd,nhijd->nhij", q, k, decay)

    # UT transform: M = (I + A_kk)^-1 by forward substitution, row i = e_i - sum_{j<i} A_kk[i, j] M[j].
    eye = torch.eye(L, dtype=q.dtype, device=q.device).expand(*A_kk.shape)
    rows: list[torch.Tensor] = []
    for i in range(L):
        earlier = torch.stack(rows, -2) if rows else eye[..., :0, :]  # [N, H, i, L]
        rows.append(eye[..., i, :] - (A_kk[..., i, :i, None] * earlier).sum(-2))
    M = torch.stack(rows, -2)  # [N, H, L, L], unit lower triangular

    # WY form: W = M diag(beta) (K Γ) [N, H, L, Dk] and U = M diag(beta) V [N, H, L, Dv]; then the deltas.
    Gamma = G.exp()
    W = M @ (beta[..., None] * k * Gamma)
    U = M @ (beta[..., None] * v)
    U_new = U - W @ S  # [N, H, L, Dv]

    # Output: the decayed incoming state read by (q Γ), plus this chunk's deltas weighted by A_qk.
    o = (q * Gamma) @ S + A_qk @ U_new

    # State leaving the chunk: S decayed by the whole chunk, plus each delta decayed from its token to the end.
    G_last = G[..., -1:, :]  # [N, H, 1, Dk]
    S = S * G_last.exp().transpose(-1, -2) + (k * (G_last - G).exp()).transpose(-1, -2) @ U_new
    return o.transpose(1, 2), S


def _pad_varlen(offsets: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices placing packed tokens into a right-padded ``[N, L]`` grid.

    Returns ``(src [N, L], valid [N, L] bool)``; src indexes the packed tokens, T meaning an extra zero row.
    """
    lens = torch.tensor([b - a for a, b in pairwise(offsets)], device=device)
    pos = torch.arange(max(int(lens.max()), 1), device=device)
    valid = pos[None, :] < lens[:, None]
    src = torch.where(valid, torch.tensor(offsets[:-1], device=device)[:, None] + pos[None, :], offsets[-1])
    return src, valid


def fused_recurrent_kda(
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
) -> _Out:
    """Recurrent KDA for decoding a few tokens; same contract as :func:`naive_recurrent_kda`.

    Dispatches (see the module docstring) to the naive reference, :func:`fused_recurrent_kda_torch` or the
    forward-only Triton kernel. Continues a :func:`chunk_kda` prefill given its final state.
    """
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
    backend = _backend(q)
    if backend == "reference":
        return naive_recurrent_kda(q, k, v, g, beta, **kw)
    if backend == "triton" and _triton_ok(q, k, v, g, beta, initial_state, grad_ok=False):
        from kimi_vl.kernels.kda_triton import fused_recurrent_kda_triton

        offsets = _check(q, k, v, g, beta, initial_state, cu_seqlens)
        return fused_recurrent_kda_triton(q, k, v, g, beta, offsets=offsets, **kw)
    with autocast_off(q):
        return fused_recurrent_kda_torch(q, k, v, g, beta, **kw)


def fused_recurrent_kda_torch(
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
) -> _Out:
    """Torch recurrent KDA, vectorised over batch and heads; same contract as :func:`naive_recurrent_kda`.

    Packed sequences are right-padded into a batch (zero padding leaves the state unchanged).
    """
    offsets = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    if offsets is not None:
        src, valid = _pad_varlen(offsets, q.device)
        q, k, v, g, beta = (torch.cat([t[0], t.new_zeros(1, *t.shape[2:])])[src] for t in (q, k, v, g, beta))
    B, T, H, Dk = q.shape
    if S is None:
        S = q.new_zeros(B, H, Dk, v.shape[-1])
    decay = g.exp().unsqueeze(-1)
    k_col, q_row = k.unsqueeze(-1), q.unsqueeze(-2)
    outputs = []
    for t in range(T):
        S = S * decay[:, t]
        delta = beta[:, t, :, None] * (v[:, t] - (k_col[:, t].transpose(-1, -2) @ S).squeeze(-2))
        S = S + k_col[:, t] * delta.unsqueeze(-2)
        outputs.append(q_row[:, t] @ S)
    o = torch.cat(outputs, -2).transpose(1, 2) if outputs else v.new_zeros(B, 0, H, v.shape[-1])
    if offsets is not None:
        o = o[valid].unsqueeze(0)
    return o.to(out_dtype), S if output_final_state else None


def _pair_decay(G: torch.Tensor) -> torch.Tensor:
    """``exp(G_i - G_j)`` for j <= i, else 0: ``[m, S, D] -> [m, S(i), S(j), D]``.

    j > i is masked to -inf *before* the exp: those differences are positive and may overflow.
    """
    S = G.shape[-2]
    upper = torch.ones(S, S, dtype=torch.bool, device=G.device).triu(1)[:, :, None]
    return (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(upper, float("-inf")).exp_()


_KEEP_BUDGET = 1 << 23  # elements of the [m, S, S, D] decay kept for backward (32 MiB in fp32)


def _groups(m: int, per_item: int, budget: int = 1 << 21) -> list[slice]:
    step = max(1, budget // per_item)
    return [slice(i, min(i + step, m)) for i in range(0, m, step)]


class _DiagBlockScores(torch.autograd.Function):
    """Scores inside the diagonal sub-blocks, with the element-wise pairwise decay.

    ``A_kk[i, j] = sum_d k_id k_jd E_ijd`` and ``A_qk[i, j] = sum_d q_id k_jd E_ijd`` with
    ``E = _pair_decay(G)``. Inputs ``[m, S, D]``, outputs ``[m, S, S]``. The ``[m, S, S, D]`` decay is
    built in groups of blocks. Up to ``_KEEP_BUDGET`` elements it and ``E * k_j`` are kept for backward
    (the sub/mask/exp passes are a third of backward's time on CPU); above it they are recomputed in backward
    instead of being stored, which bounds memory. Kept or recomputed, backward sees the same values.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(q, k, G)
        m, S, D = k.shape
        keep = any(ctx.needs_input_grad) and m * S * S * D <= _KEEP_BUDGET  # nothing to keep for inference
        ctx.kept = []
        out = k.new_empty(m, S, S, 2)
        for sl in _groups(m, S * S * D):
            E = _pair_decay(G[sl])
            k_decay = E * k[sl].unsqueeze(-3) if keep else E.mul_(k[sl].unsqueeze(-3))
            if keep:
                ctx.kept.append((E, k_decay))
            torch.matmul(k_decay, torch.stack([k[sl], q[sl]], -1), out=out[sl])
        return out[..., 0], out[..., 1]

    @staticmethod
    @once_differentiable
    def backward(ctx, d_kk: torch.Tensor | None, d_qk: torch.Tensor | None):
        q, k, G = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, []
        m, S, D = k.shape
        dA = torch.stack([k.new_zeros(m, S, S) if d is None else d for d in (d_kk, d_qk)], -1)  # [m, S, S, 2]
        dq, dk, dG = torch.empty_like(q), torch.empty_like(k), torch.empty_like(G)
        for n, sl in enumerate(_groups(m, S * S * D)):
            k_j = k[sl].unsqueeze(-3)
            if kept:
                E, k_decay = kept[n]
            else:
                E = _pair_decay(G[sl])
                k_decay = E * k_j
            rows = dA[sl].transpose(-1, -2) @ k_decay  # [m, S(i), 2, D]: d/dk_i and d/dq_i
            R = (dA[sl] @ torch.stack([k[sl], q[sl]], -2)).mul_(E)  # [m, i, j, D]: sum_x dA_x[i,j] x_id E_ijd
            dk[sl] = rows[..., 0, :] + R.sum(-3)
            dq[sl] = rows[..., 1, :]
            P = R.mul_(k_j)
            dG[sl] = P.sum(-2) - P.sum(-3)
        return dq, dk, dG


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Intra-chunk score matrices ``A_kk`` and ``A_qk``, both ``[N, Z, C, C]``.

    ``A[i, j] = sum_d x_{i,d} k_{j,d} exp(G_{i,d} - G_{j,d})`` for j <= i (x = k or q), zero above the
    diagonal; ``A_kk``'s diagonal is not meaningful (the unit-triangular solve ignores it).
    Inputs q, k, G (in-chunk cumulative log decay) are ``[N, Z, C, Dk]``.

    Blocks below the 16x16 block diagonal are matmuls with the decay split at the first token n of the
    row's sub-chunk: ``(x_i e^{G_i - G_n}) . (k_j e^{G_n - G_j})`` with j < n <= i, so both factors are <= 1.
    Only the diagonal sub-blocks need the element-wise pairwise decay.
    """
    N, Z, C, D = q.shape
    S, ns = SUB_CHUNK, C // SUB_CHUNK
    qs, ks, Gs = (t.view(N, Z, ns, S, D) for t in (q, k, G))
    dev = q.device

    diag_kk, diag_qk = _DiagBlockScores.apply(*(t.reshape(-1, S, D) for t in (qs, ks, Gs)))
    diag_kk, diag_qk = diag_kk.view(N, Z, ns, S, S), diag_qk.view(N, Z, ns, S, S)
    eye = torch.eye(ns, dtype=q.dtype, device=dev)[:, None, :, None]
    diag_kk = (diag_kk.unsqueeze(-2) * eye).reshape(N, Z, C, C)
    diag_qk = (diag_qk.unsqueeze(-2) * eye).reshape(N, Z, C, C)

    # Off-diagonal sub-blocks: rows of sub-chunks 1..ns-1 against columns 0..C-S-1.
    G_ref = Gs[:, :, 1:, :1]  # [N, Z, ns-1, 1, D]: G at each row sub-chunk's first token
    row_decay = (Gs[:, :, 1:] - G_ref).exp()
    later = torch.arange(C - S, device=dev)[None, :] >= torch.arange(S, C, S, device=dev)[:, None]
    col_decay = (G_ref - G[:, :, None, : C - S]).masked_fill(later[:, :, None], float("-inf")).exp()
    k_col = k[:, :, None, : C - S] * col_decay  # [N, Z, ns-1, C-S, D]
    rows = torch.cat([ks[:, :, 1:], qs[:, :, 1:]], -2) * torch.cat([row_decay, row_decay], -2)
    off = rows @ k_col.transpose(-1, -2)  # [N, Z, ns-1, 2S, C-S]
    off_kk, off_qk = (F.pad(t.reshape(N, Z, C - S, C - S), (0, S, S, 0)) for t in off.split(S, -2))
    return diag_kk + off_kk, diag_qk + off_qk


def _chunk_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    waves: list[int],
    h0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA on chunk-major tensors, independent sequences advancing together.

    q, k, g: ``[N, Z, C, Dk]``; v: ``[N, Z, C, Dv]``; beta: ``[N, Z, C]`` (N chunks, Z = heads of the state).
    The chunks are laid out wave by wave: with the sequences ordered by decreasing chunk count, wave ``w`` is the
    next ``waves[w]`` chunks, chunk ``w`` of each of the first ``waves[w]`` sequences (those still running are
    always a prefix). ``h0 [M, Z, Dk, Dv]``: the initial states of the M sequences in that order (a sequence with
    no chunk keeps its own). Returns ``(o [N, Z, C, Dv], final states [M, Z, Dk, Dv])``.
    """
    N, Z, C, Dk = q.shape
    Dv = v.shape[-1]
    G = g.cumsum(-2)
    A_kk, A_qk = _intra_chunk(q, k, G)

    # UT transform: (I + diag(beta) A_kk) [U | W] = diag(beta) [V | exp(G) K].
    G_exp = G.exp()
    rhs = torch.cat([v, k * G_exp], -1) * beta.unsqueeze(-1)
    UW = torch.linalg.solve_triangular(A_kk * beta.unsqueeze(-1), rhs, upper=False, unitriangular=True)
    U, W = UW.split([Dv, Dk], -1)

    # One matmul per wave yields both W S (the state's prediction) and (Q exp(G)) S (inter-chunk output).
    WQ = torch.cat([W, q * G_exp], -2)  # [N, Z, 2C, Dk]
    G_last = G[:, :, -1:]
    k_to_end = (k * (G_last - G).exp()).transpose(-1, -2)  # [N, Z, Dk, C]
    decay_end = G_last.exp().transpose(-1, -2)  # [N, Z, Dk, 1]

    # split (not indexing) so backward concatenates the per-wave grads once instead of scattering into zeros.
    WQ, U, k_to_end, decay_end = (t.split(waves) for t in (WQ, U, k_to_end, decay_end))
    S, finals, v_new, o_inter = h0, [], [], []
    for w, running in enumerate(waves):
        S, ended = S.split([running, len(S) - running])
        finals.append(ended)
        proj = WQ[w] @ S
        vn = U[w] - proj[..., :C, :]
        v_new.append(vn)
        o_inter.append(proj[..., C:, :])
        S = S * decay_end[w] + k_to_end[w] @ vn
    finals.append(S)
    o = torch.cat(o_inter) + A_qk @ torch.cat(v_new)
    return o, torch.cat(finals[::-1])


def chunk_kda(
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
) -> _Out:
    """Chunked KDA (WY/UT transform); same contract as :func:`naive_recurrent_kda`, differentiable.

    Args: q, k, g ``[B, T, H, Dk]`` (g = per-channel log decay <= 0); v ``[B, T, H, Dv]``; beta ``[B, T, H]``;
    scale (default ``Dk**-0.5``, applied after the optional L2 norm); initial_state ``[N, H, Dk, Dv]``;
    cu_seqlens ``[N+1]`` offsets of packed sequences (B must be 1).
    Returns ``(o [B, T, H, Dv] in q's dtype, final_state [N, H, Dk, Dv] fp32 (fp64 for fp64 input) or None)``.
    The chunked paths count gates below ``GATE_FLOOR`` (-inf included: a hard reset) as ``GATE_FLOOR``.
    Dispatches (see the module docstring) to the naive reference, :func:`chunk_kda_torch` or the Triton
    kernels (forward and backward).
    """
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
    backend = _backend(q)
    if backend == "reference":
        return naive_recurrent_kda(q, k, v, g, beta, **kw)
    if backend == "triton" and _triton_ok(q, k, v, g, beta, initial_state):
        from kimi_vl.kernels.kda_triton import chunk_kda_triton

        offsets = _check(q, k, v, g, beta, initial_state, cu_seqlens)
        kw.pop("cu_seqlens")
        return chunk_kda_triton(q, k, v, g, beta, offsets=offsets, **kw)
    with autocast_off(q):
        return chunk_kda_torch(q, k, v, g, beta, **kw)


def chunk_kda_torch(
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
) -> _Out:
    """The torch chunked KDA (WY/UT transform, differentiable); contract of :func:`chunk_kda`."""
    offsets = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if q.shape[1] == 0:
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                                   cu_seqlens=cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta, h0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    g = g.clamp_min(GATE_FLOOR)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = TORCH_CHUNK

    if offsets is None:  # B sequences of n chunks: n waves of B
        pad = (-T) % C
        n = (T + pad) // C
        waves = [B] * n

        def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, *] -> [n * B, H, C, *]
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
            return x.reshape(B, n, C, H, -1).permute(1, 0, 3, 2, 4).reshape(n * B, H, C, -1)

        h0 = q.new_zeros(B, H, Dk, Dv) if h0 is None else h0
    else:
        # Each sequence is right-padded to a whole number of chunks (zero padding leaves its state unchanged) and
        # its chunk j is placed in wave j (see _chunk_core), sequences by decreasing length. Tokens are copied to
        # their padded positions (`dst`): the backward is a gather, not an accumulating scatter.
        n_chunks = [-(-(b - a) // C) for a, b in pairwise(offsets)]
        order = sorted(range(len(n_chunks)), key=lambda i: -n_chunks[i])
        rank = [0] * len(order)
        for r, i in enumerate(order):
            rank[i] = r
        waves = [sum(m > w for m in n_chunks) for w in range(max(n_chunks))]
        wave_start = [0, *accumulate(waves)]
        dst = [(wave_start[p // C] + rank[i]) * C + p % C
               for i, (a, b) in enumerate(pairwise(offsets)) for p in range(b - a)]
        n = wave_start[-1]
        dst_idx = torch.tensor(dst, dtype=torch.long, device=q.device)

        def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [1, T, H, *] -> [n, H, C, *]
            x = x.new_zeros(n * C, *x.shape[2:]).index_copy(0, dst_idx, x[0])
            return x.reshape(n, C, H, -1).transpose(1, 2)

        sorted_idx = torch.tensor(order, device=q.device)
        h0 = q.new_zeros(len(order), H, Dk, Dv) if h0 is None else h0.index_select(0, sorted_idx)

    qc, kc, vc, gc = (to_chunks(t) for t in (q, k, v, g))
    o, final = _chunk_core(qc, kc, vc, gc, to_chunks(beta.unsqueeze(-1)).squeeze(-1), waves, h0)

    if offsets is None:
        o = o.reshape(n, B, H, C, Dv).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, Dv)[:, :T]
    else:
        o = o.transpose(1, 2).reshape(n * C, H, Dv).index_select(0, dst_idx).unsqueeze(0)
        final = final.index_select(0, torch.tensor(rank, device=q.device))
    return o.to(out_dtype), final if output_final_state else None
