"""Attention Residuals (arXiv 2603.15031): each sublayer reads a softmax-over-depth mixture of earlier sources
instead of the fixed residual sum.

Sublayer `l` (attention and FFN count separately) reads

    h_l = n_l * sum_i softmax_i(w_l . RMSNorm_l(v_i)) v_i

over its `n_l` sources `v_i`: the token embedding, the completed block sums and (after a block's first sublayer)
the current block's partial sum. `attnres_block_size = 1` gives Full AttnRes (every sublayer output is a source).
`w_l` are pseudo-queries, zero-initialised, so training starts from uniform weights `1/n_l`. A final aggregation
with its own query precedes the final norm.

The factor `n_l` (the number of sources) is a constant per sublayer that the following PreNorm removes; it only
makes the zero-query model *exactly* the standard PreNorm model instead of equal up to the norm's eps, so a
converted standard checkpoint keeps its logits when AttnRes is switched on. The softmax weights are the paper's.

Two computations give the same result: `direct` (stack the sources, softmax, weighted sum; readable, used by
tests) and the default two-phase path (per block, one batched attention of all its sublayers' queries over the
completed blocks, then an online-softmax merge with the running partial sum).

All AttnRes parameters are 1-D (queries and key-norm gains) and `AttnResidual` declares them `ADAMW`
(`kimi_vl.optim_contract`): they must never be orthogonalised by Muon.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..activation_checkpointing import run_checkpointed
from ..kernels.autocast import autocast_off
from ..optim_contract import ADAMW


@dataclass
class AttnResState:
    """Per-forward bookkeeping: completed sources `[B, T, d]` (embedding, block sums), their key-normalised
    copies (fp32, no gain), the partial sum of the current block, and the phase-1 stats of the current block."""

    sources: list[torch.Tensor]
    normed: list[torch.Tensor]
    partial: torch.Tensor | None = None
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


class AttnResidual(nn.Module):
    """Attention Residuals over `num_sublayers` sublayers with blocks of `block_size` sublayers.

    Same interface as `StandardResidual`: `begin(embeds) -> state`, `read(state, l) -> h_l [B, T, d]`,
    `write(state, l, out) -> state`, `end(state) -> [B, T, d]` (before the final norm).
    """

    optimizer_routes = {"queries": ADAMW, "key_norms": ADAMW, "final_query": ADAMW, "final_key_norm": ADAMW}

    def __init__(self, hidden_size: int, num_sublayers: int, block_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_sublayers = num_sublayers
        self.block_size = block_size
        self.eps = eps
        # Sublayer 0 reads the embedding alone (one source, nothing to weigh): queries start at sublayer 1.
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(hidden_size)) for _ in range(num_sublayers - 1))
        self.key_norms = nn.ParameterList(nn.Parameter(torch.ones(hidden_size)) for _ in range(num_sublayers - 1))
        self.final_query = nn.Parameter(torch.zeros(hidden_size))
        self.final_key_norm = nn.Parameter(torch.ones(hidden_size))
        self.two_phase = True
        self.gradient_checkpointing = False  # set with the model's: the depth mixing is recomputed too

    def extra_repr(self) -> str:
        return f"sublayers={self.num_sublayers}, block_size={self.block_size}, two_phase={self.two_phase}"

    def _normalise(self, v: torch.Tensor) -> torch.Tensor:
        vf = v.float()
        return vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + self.eps)

    def _query(self, l: int) -> torch.Tensor:
        """The effective query `w_l * gain_l` (the key-norm gain folds into the query), fp32 `[d]`."""
        if l == self.num_sublayers:
            return (self.final_query * self.final_key_norm).float()
        return (self.queries[l - 1] * self.key_norms[l - 1]).float()

    # --- the residual-stream interface -------------------------------------------------------------------------
    def begin(self, embeds: torch.Tensor) -> AttnResState:
        return AttnResState(sources=[embeds], normed=[self._normalise(embeds)])

    def read(self, state: AttnResState, l: int) -> torch.Tensor:
        first = l - l % self.block_size
        if l == first and state.partial is not None:  # a block just ended: it becomes a source
            state.sources.append(state.partial)
            state.normed.append(self._normalise(state.partial))
            state.partial = None
        if self.two_phase and l == first:
            layers = range(max(first, 1), min(first + self.block_size, self.num_sublayers))
            # the lists grow after this block: a recomputation must see them as they are now
            state.stats = run_checkpointed(self, self._phase1, list(state.normed), list(state.sources), layers) \
                if layers else None
        if l == 0:
            return state.sources[0]
        if not self.two_phase:
            return self._direct(state, l)
        o, m, s = (t[:, :, l - max(first, 1)] for t in state.stats)
        n, dtype = len(state.sources), state.sources[0].dtype
        return run_checkpointed(self, self._phase2, o, m, s, n, state.partial, l, dtype)

    def write(self, state: AttnResState, l: int, out: torch.Tensor) -> AttnResState:
        state.partial = out if state.partial is None else state.partial + out
        return state

    def end(self, state: AttnResState) -> torch.Tensor:
        return self._direct(state, self.num_sublayers)

    # --- the two computations ----------------------------------------------------------------------------------
    def depth_weights(self, state: AttnResState, l: int) -> torch.Tensor:
        """Softmax over depth of sublayer `l >= 1` (`l = num_sublayers`: the final aggregation) over the current
        sources (completed ones, then the partial sum if any): `[n, B, T]`, fp32, summing to 1 per token."""
        normed = state.normed + ([self._normalise(state.partial)] if state.partial is not None else [])
        with autocast_off(normed[0]):
            return torch.stack([k @ self._query(l) for k in normed], 0).softmax(0)

    def _direct(self, state: AttnResState, l: int) -> torch.Tensor:
        """Softmax over all current sources at once. Returns `[B, T, d]` in the sources' dtype."""
        values = state.sources + ([state.partial] if state.partial is not None else [])
        weights = self.depth_weights(state, l)
        h = sum(w[..., None] * v.float() for w, v in zip(weights, values))
        return (len(values) * h).to(values[0].dtype)

    def _phase1(self, normed: list[torch.Tensor], sources: list[torch.Tensor], layers: range):
        """All queries of a block (sublayers `layers`) against the completed sources (`normed`, their key-normalised
        copies): unnormalised sum `o [B, T, S, d]`, max and exp-sum `[B, T, S]` per query."""
        q = torch.stack([self._query(l) for l in layers])  # [S, d]
        keys = torch.stack(normed, 2)  # [B, T, n, d]
        with autocast_off(keys):  # fp32 in bf16 mixed precision too
            logits = keys @ q.T  # [B, T, n, S]
            m = logits.amax(2)
            e = (logits - m[:, :, None]).exp()
            values = torch.stack(sources, 2).float()  # [B, T, n, d]
            o = e.transpose(2, 3) @ values  # [B, T, S, d]
        return o, m, e.sum(2)

    def _phase2(self, o: torch.Tensor, m: torch.Tensor, s: torch.Tensor, n: int, p: torch.Tensor | None, l: int,
                dtype: torch.dtype) -> torch.Tensor:
        """Sublayer `l`'s reading from its phase-1 stats (`o [B, T, d]`, `m`, `s [B, T]`, over `n` completed
        sources) merged with the partial sum `p` (online softmax); `[B, T, d]` in `p`'s dtype, else `dtype`."""
        if p is None:
            return (n * o / s[..., None]).to(dtype)
        with autocast_off(p):
            logit = self._normalise(p) @ self._query(l)  # [B, T]
        m_new = torch.maximum(m, logit)
        a, b = (m - m_new).exp(), (logit - m_new).exp()
        h = (a[..., None] * o + b[..., None] * p.float()) / (a * s + b)[..., None]
        return ((n + 1) * h).to(p.dtype)
