"""The KDA (Kimi Delta Attention) layer: projections, short conv, gates and gated output norm over the
`kimi_vl.kernels` KDA ops. Parameter names and shapes follow the released Kimi-Linear checkpoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import causal_conv1d, chunk_kda, fused_recurrent_kda
from .cache import KimiHybridCache
from .configuration import KimiTextConfig
from .norm import GatedRMSNorm

# Up to this many new tokens with a cached state, the recurrent kernel is cheaper than the chunked one.
RECURRENT_MAX_TOKENS = 16


def padding_runs_packed(padding_mask: torch.Tensor, continues_state: bool, keeps_state: bool) -> bool:
    """Whether KDA must run the rows of `padding_mask [B, T]` (1 = token) as packed sequences rather than zero the
    pads in place: when the tokens continue a cached state (`continues_state`), or pads follow tokens (right or
    inner padding) and either the state is kept (`keeps_state`: a cache) or tokens follow pads too. One read of the
    mask on the host."""
    keep = padding_mask.bool()
    rises, falls = torch.stack([(keep[:, 1:] > keep[:, :-1]).any(), (keep[:, 1:] < keep[:, :-1]).any()]).tolist()
    return continues_state or (falls and (keeps_state or rises))


class KimiDeltaAttention(nn.Module):
    """`o_proj(GatedRMSNorm(KDA(q, k, v, g, beta), sigmoid gate))` with
    `q, k, v = SiLU(conv4(W x))`, `g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`, `beta = sigmoid(b(x))`.

    Shapes: `x [B, T, hidden] -> [B, T, hidden]`.
    """

    def __init__(self, config: KimiTextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = h = config.kda_num_heads
        self.head_dim = d = config.kda_head_dim
        proj = h * d
        hidden = config.hidden_size
        kernel = config.short_conv_kernel_size
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        # Depthwise causal convs; only their weights `[proj, 1, kernel]` are used (one fused conv call).
        self.q_conv1d = nn.Conv1d(proj, proj, kernel, groups=proj, bias=False)
        self.k_conv1d = nn.Conv1d(proj, proj, kernel, groups=proj, bias=False)
        self.v_conv1d = nn.Conv1d(proj, proj, kernel, groups=proj, bias=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, h, 1))
        self.dt_bias = nn.Parameter(torch.empty(proj))
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, proj, bias=False)
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, proj, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        cache: KimiHybridCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        packed_padding: bool | None = None,
    ) -> torch.Tensor:
        """x `[B, T, hidden]`; padding_mask `[B, T]` (1 = token, 0 = pad; pads never enter the conv or the state,
        and their outputs are zeros); cu_seqlens `[N+1]` for packed independent sequences (B = 1).

        Left padding before the first state (a prompt) and right padding without a cache are zeroed in place: a
        zero input changes nothing there. Any other padding (pads between tokens, before tokens that continue a
        cached state, or after tokens whose state the cache keeps) takes each row's tokens out of the padding and
        runs them as packed sequences, continuing the rows' cached states and conv tails. `packed_padding`: that
        choice (`padding_runs_packed`), made once for all the model's layers; None: made here."""
        B, T, _ = x.shape
        state = tail = None
        if cache is not None:
            state, tail = cache.recurrent_states[self.layer_idx], cache.conv_tails[self.layer_idx]
        if padding_mask is None:
            return self._mix(x, state, tail, cache, cu_seqlens)
        if packed_padding is None:
            packed_padding = padding_runs_packed(padding_mask, state is not None, cache is not None)
        if not packed_padding:
            return self._mix(x * padding_mask[..., None].to(x.dtype), state, tail, cache, cu_seqlens)
        keep = padding_mask.bool()
        packed_cu = F.pad(keep.sum(1).cumsum(0), (1, 0))  # [B + 1]: row b's tokens are packed sequence b
        out = self._mix(x[keep][None], state, tail, cache, packed_cu)
        return out.new_zeros(B, T, out.shape[-1]).masked_scatter(keep[..., None], out)

    def _mix(
        self,
        x: torch.Tensor,
        state: torch.Tensor | None,
        tail: torch.Tensor | None,
        cache: KimiHybridCache | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The layer on unpadded `x [B, T, hidden]` from the cached `state [N, H, Dk, Dv]` and conv `tail`
        `[N, 3*H*Dk, kernel-1]` (or None), N = B or the `cu_seqlens` `[N+1]` sequences; stores the new ones in
        `cache` when given."""
        B, T, _ = x.shape
        h, d = self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        qkv, new_tail = causal_conv1d(
            qkv, conv_w, tail=tail, cu_seqlens=cu_seqlens, activation="silu", output_tail=cache is not None
        )
        q, k, v = (t.reshape(B, T, h, d) for t in qkv.split(h * d, dim=-1))

        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = -self.A_log.float().exp() * F.softplus(g.view(B, T, h, d), threshold=20.0)
        beta = torch.sigmoid(self.b_proj(x).float())

        kda = fused_recurrent_kda if state is not None and T <= RECURRENT_MAX_TOKENS else chunk_kda
        o, new_state = kda(
            q, k, v, g, beta, initial_state=state, output_final_state=cache is not None,
            use_qk_l2norm=True, cu_seqlens=cu_seqlens,
        )
        if cache is not None:
            cache.update_kda(self.layer_idx, new_state, new_tail)

        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, h, d)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, h * d))
