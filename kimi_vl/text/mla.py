"""Multi-head latent attention: NoPE (`"mla"` layers, as in Kimi-Linear) or with rotary position on the rope slice
(`"mla_rope"` layers, as in DeepSeek-V3 / Kimi K2).

Keys are `[k_nope_h ; k_pe]` where `k_nope_h, v_h` are expanded from a normalised latent `c` (rank
`kv_lora_rank`) and `k_pe` is one slice shared by all heads. Queries come from `q_proj(x)` or, with
`q_lora_rank`, from `q_b_proj(RMSNorm(q_a_proj(x)))`. In `"mla_rope"` layers the query slices `q_pe` and the shared
`k_pe` are rotated by their token positions (`kimi_vl.text.rope`) before anything else sees them, so the cache holds
the *rotated* key: `[c ; rope(k_pe)]` per token, the same width as NoPE's `[c ; k_pe]`. Prefill uses the expanded
form (SDPA); decoding a few tokens against a cache uses the absorbed form, which never expands the cached latent
into per-head keys and values (the new queries are rotated at their own positions, the cached keys already are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ShapeError
from ..kernels import max_logits, packed_max_logits
from ..kernels.offsets import host_offsets
from ..optim_contract import MaxLogitRecorder
from .cache import KimiHybridCache
from .configuration import KimiTextConfig
from .norm import RMSNorm
from .rope import apply_rotary, softmax_scale_multiplier

# With a cache, at most this many new tokens take the absorbed (latent-space) path.
ABSORB_MAX_TOKENS = 16

Rotation = tuple[torch.Tensor, torch.Tensor]


class MultiHeadLatentAttention(MaxLogitRecorder, nn.Module):
    """Shapes: `x [B, T, hidden] -> [B, T, hidden]`; attention over `[c ; k_pe]` of all cached + new tokens.

    A QK-Clip target (`kimi_vl.optim_contract.QKClipTarget`): with `record_max_logits = True` (set by the
    optimizer), every forward folds the per-head max pre-softmax logit `max q.k * scale` over the pairs it actually
    attends (masked pairs never count) into `max_logits` (`[num_heads]`, fp32, element-wise max across forwards
    until reset to None); `qk_clip_row_scales` gives the K2 MLA rule.
    """

    qk_clip_group = "text"

    def __init__(self, config: KimiTextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        self.use_rope = config.layer_types[layer_idx] == "mla_rope"
        self.scale = config.qk_head_dim**-0.5
        if self.use_rope:  # DeepSeek-V3's YaRN temperature (1 unless a scaled rope type sets mscale_all_dim)
            self.scale *= softmax_scale_multiplier(config.rope_parameters, config.max_position_embeddings)
        hidden, h, bias = config.hidden_size, self.num_heads, config.attention_bias
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.mla_kv_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=config.mla_kv_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, hidden, bias=bias)

    def queries(self, x: torch.Tensor, rope: Rotation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [B, T, hidden]` -> `q_nope [B, h, T, nope]`, `q_pe [B, h, T, rope]` (rotated by `rope` = cos, sin
        `[B, T, rope]` in `"mla_rope"` layers)."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:2], self.num_heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        if self.use_rope:
            q_pe = apply_rotary(q_pe, *(t[:, None] for t in self._rotation(rope)))
        return q_nope, q_pe

    def latent(self, x: torch.Tensor, rope: Rotation | None = None) -> torch.Tensor:
        """`x [B, T, hidden]` -> the cached per-token latent `[B, T, rank + rope]` = `[RMSNorm(c) ; k_pe]` (`k_pe`
        rotated by `rope` in `"mla_rope"` layers)."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        if self.use_rope:
            k_pe = apply_rotary(k_pe, *self._rotation(rope))
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def _rotation(self, rope: Rotation | None) -> Rotation:
        if rope is None:
            raise ShapeError(f"MLA layer {self.layer_idx} is a RoPE layer ('mla_rope'): pass rope=(cos, sin) of its "
                             "tokens' positions (KimiTextModel computes them).")
        return rope

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: KimiHybridCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        rope: Rotation | None = None,
    ) -> torch.Tensor:
        """attn_mask: boolean `[B, 1, T, L]` (True = attend) or None for plain causal attention over the new
        tokens (L = cached + T). cu_seqlens `[N+1]` (B = 1): causal attention within each packed sequence.
        rope: cos, sin `[B or 1, T, qk_rope_head_dim]` of the new tokens' positions (`"mla_rope"` layers only)."""
        B, T, _ = x.shape
        q_nope, q_pe = self.queries(x, rope)
        latent = self.latent(x, rope)
        if cache is not None:
            latent = cache.update_latent(self.layer_idx, latent)
        if cache is not None and T <= ABSORB_MAX_TOKENS and latent.shape[1] > T:
            out = self._absorbed(q_nope, q_pe, latent, attn_mask)
        else:
            out = self._expanded(q_nope, q_pe, latent, attn_mask, cu_seqlens)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def _kv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`W_UK [h, nope, rank]`, `W_UV [h, v, rank]` from `kv_b_proj`."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _expanded(self, q_nope, q_pe, latent, attn_mask, cu_seqlens) -> torch.Tensor:
        B, h, T, _ = q_nope.shape
        L = latent.shape[1]
        c, k_pe = latent.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(B, L, h, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(B, h, L, self.rope_dim)], dim=-1)
        if self.record_max_logits:
            self._record_expanded(q, k, attn_mask, cu_seqlens)
        if cu_seqlens is not None:
            bounds = host_offsets(cu_seqlens)
            return torch.cat(
                [
                    F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                   scale=self.scale)
                    for s, e in zip(bounds[:-1], bounds[1:])
                ],
                dim=2,
            )
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)

    def _absorbed(self, q_nope, q_pe, latent, attn_mask) -> torch.Tensor:
        """Scores `[W_UK^T q_nope ; q_pe] . [c ; k_pe]` in latent space (heads and new tokens are the query rows,
        `scale` folded into them); output `W_UV (sum_j p_j c_j)`. The cached latent is read in place, twice (scores,
        then the weighted sum): never expanded per head, copied or transposed. Layout matters at long context:
        the scores are computed cache rows first, `latent [B, L, D] @ q^T` (BLAS runs this tall-skinny product
        about 2x faster on CPU than `q @ latent^T`), and the softmax runs in place on them (fp32), its
        normalisation applied to the mixed latent, so that no other tensor of the cache's length is allocated."""
        B, h, T, _ = q_nope.shape
        w_uk, w_uv = self._kv_weights()
        q_lat = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_pe], dim=-1) * self.scale
        scores = (latent @ q_lat.view(B, h * T, -1).transpose(1, 2)).float().view(B, -1, h, T)  # [B, L, h, T]
        if attn_mask is not None:  # None only for a single new token, which sees the whole cache
            scores.masked_fill_(~attn_mask.permute(0, 3, 1, 2), float("-inf"))
        top = scores.detach().amax(1, keepdim=True)  # a constant shift for the softmax
        if self.record_max_logits:
            self.fold_max_logits(top.amax(dim=(0, 1, 3)))
        weights = scores.sub_(top).exp_().view(B, -1, h * T)  # unnormalised softmax, [B, L, h * T]
        mixed = weights.transpose(1, 2).to(latent.dtype) @ latent[..., : self.rank]  # [B, h * T, rank]
        o_lat = (mixed / weights.sum(1)[..., None]).view(B, h, T, self.rank).to(latent.dtype)
        return torch.einsum("bhtr,hvr->bhtv", o_lat, w_uv)

    @torch.no_grad()
    def _record_expanded(self, q, k, attn_mask, cu_seqlens) -> None:
        """Fold the per-head max of `q.k * scale` over the pairs the expanded path attends into `max_logits`: the
        same masks as its SDPA calls (`cu_seqlens`: causal per packed sequence; no mask: causal top-left when
        T > 1; else `attn_mask`), computed blockwise (`kimi_vl.kernels.max_logits`)."""
        if cu_seqlens is not None:
            for b in range(q.shape[0]):  # the same packing in every row (KimiTextModel packs into one row)
                self.fold_max_logits(packed_max_logits(q[b].transpose(0, 1), k[b].transpose(0, 1), cu_seqlens,
                                                       self.scale, causal=True))
        else:
            self.fold_max_logits(max_logits(q, k, self.scale, causal=attn_mask is None and q.shape[2] > 1,
                                            mask=attn_mask))

    def qk_clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """QK-Clip's MLA rule for `gamma` `[num_heads]`: head h's q_nope and k_nope rows (`kv_b_proj`) by
        sqrt(gamma[h]), its q_pe rows by gamma[h] (`q_proj`, or `q_b_proj` with a low-rank query). The shared
        rotary key (`kv_a_proj_with_mqa`), the values, `o_proj` and the down-projections are never touched, so
        every logit of head h scales by exactly gamma[h] (also in `"mla_rope"` layers: rotation is linear per
        token) and no other head changes. Returns `(weight, row_scale)` pairs, fp32 CPU row scales."""
        h, nope, rope, v = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        g = gamma.detach().to(device="cpu", dtype=torch.float32)
        root = g.sqrt()
        q_rows = torch.cat([root[:, None].expand(h, nope), g[:, None].expand(h, rope)], dim=1).reshape(-1)
        kv_rows = torch.cat([root[:, None].expand(h, nope), torch.ones(h, v)], dim=1).reshape(-1)
        q_weight = self.q_proj.weight if self.q_lora_rank is None else self.q_b_proj.weight
        return [(q_weight, q_rows), (self.kv_b_proj.weight, kv_rows)]
