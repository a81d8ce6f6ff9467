"""MoonViT-3D: the native-resolution vision encoder of Kimi K2.5, weight-compatible with transformers'
`Kimi_K25VisionModel` (import released weights with `kimi_vl.vision.convert.convert_kimi_k25_vision`).

Pipeline for a pack of images and video clips (`grid_thw` rows `(t, h, w)` in patches):

1. 14x14 patch embedding (a `Conv2d` weight, applied as one matmul over the flattened patches);
2. plus the learned `(pos_emb_height, pos_emb_width)` position table, resampled bicubically
   (`align_corners=False`, no antialias) to each grid, and, for clips of more than one frame, an additive
   sinusoidal time embedding of the frame index within its temporal chunk;
3. pre-norm blocks: LayerNorm -> fused qkv -> 2-D rotary embedding on q, k -> packed varlen attention
   (`kimi_vl.kernels.packed_attention`; each temporal chunk or image attends only to itself) -> proj,
   LayerNorm -> MLP (fc1, tanh-GELU, fc2);
4. final LayerNorm;
5. `kh x kw` spatial merge with a temporal mean over each chunk: `pooler_output[m]` holds the `kh*kw` patches
   (row-major) of merged token `m`, averaged over the chunk's frames.

Videos: a clip with `t > temporal_chunk_size` frames is split into chunks of `temporal_chunk_size` frames
(the last may be shorter), exactly as transformers' `Kimi_K25VideoProcessor` splits clips into separate
`grid_thw` rows, so `[[8, h, w]]` here equals transformers' `[[4, h, w], [4, h, w]]`. A one-frame chunk
gets no time embedding (like an image).

Rotary layout: transformers' rotate-half form. Channel `j < head_dim/2` of a head pairs with `j + head_dim/2`
and rotates by `col * f_{j//2}` for even `j`, `row * f_{j//2}` for odd `j`, `f_i = theta^(-4i/head_dim)`.

timm building blocks: `timm.layers.Mlp` (the fc1/GELU-tanh/fc2 MLP, same keys as transformers),
`timm.layers.resample_abs_pos_embed` (bicubic resampling of the position table, `antialias=False`),
`timm.layers.apply_rot_embed` (rotate-half rotary application, computed in fp32) and
`timm.layers.get_act_layer` (QuickGELU). The GELU of the MLP is ours: it runs in place when no gradient flows
(`torch.ops.aten.gelu_`), which lowers inference peak memory by one `[tokens, intermediate_size]` buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import Mlp, apply_rot_embed, get_act_layer, resample_abs_pos_embed
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..activation_checkpointing import run_checkpointed
from ..errors import ShapeError
from ..kernels import packed_attention, packed_max_logits
from ..offloading import RefusesOffloading
from ..optim_contract import MaxLogitRecorder
from .configuration import MoonViTConfig

Rope = tuple[torch.Tensor, torch.Tensor]
"""`(sin, cos)`, each `[total_tokens, 1, head_dim]` fp32."""


@dataclass
class PackLayout:
    """Per-token bookkeeping of one pack, computed once per forward and shared by all blocks.

    Attributes:
        chunks: `(t, h, w)` per attention segment (images and temporal chunks), in pack order.
        cu_seqlens: `[num_chunks + 1]` int32 token offsets of the segments.
        rows, cols: `[total_tokens]` patch row / column inside its frame.
        frames: `[total_tokens]` frame index inside its chunk (0 for images).
    """

    chunks: list[tuple[int, int, int]]
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    frames: torch.Tensor


def split_chunks(grid_thw: torch.Tensor, chunk_size: int) -> list[tuple[int, int, int]]:
    """Split each `(t, h, w)` row into temporal chunks of at most `chunk_size` frames."""
    chunks = []
    for t, h, w in grid_thw.tolist():
        for start in range(0, t, chunk_size):
            chunks.append((min(chunk_size, t - start), h, w))
    return chunks


def build_layout(chunks: list[tuple[int, int, int]], device: torch.device) -> PackLayout:
    rows, cols, frames, lengths = [], [], [], []
    for t, h, w in chunks:
        index = torch.arange(t * h * w, device=device)
        rows.append(index // w % h)
        cols.append(index % w)
        frames.append(index // (h * w))
        lengths.append(t * h * w)
    cu_seqlens = F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)).to(torch.int32)
    return PackLayout(chunks, cu_seqlens, torch.cat(rows), torch.cat(cols), torch.cat(frames))


def sinusoidal_time_embedding(num_frames: int, dim: int, device: torch.device) -> torch.Tensor:
    """`[num_frames, dim]` = `[sin(f * w_i) | cos(f * w_i)]` with `w_i = 10000^(-2i/dim)`, fp32."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.arange(num_frames, device=device, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class GELU(nn.Module):
    """GELU (`approximate="tanh"` or `"none"`) that overwrites its input when no gradient flows through it, so
    inference keeps one `[tokens, intermediate_size]` buffer fewer; out of place otherwise."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.gelu(x, approximate=self.approximate)
        return torch.ops.aten.gelu_(x, approximate=self.approximate)


def activation(name: str) -> type[nn.Module] | Callable[[], nn.Module]:
    """The MLP activation for `config.hidden_act`."""
    if name == "quick_gelu":
        return get_act_layer("quick_gelu")
    return partial(GELU, "tanh" if name == "gelu_pytorch_tanh" else "none")


class MoonViTPatchEmbed(nn.Module):
    """Patch projection plus the resampled learned 2-D position table and the time embedding."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.temporal_chunk_size = config.temporal_chunk_size
        self.proj = nn.Conv2d(3, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size)
        self.pos_emb = nn.Parameter(torch.zeros(config.pos_emb_height, config.pos_emb_width, config.hidden_size))

    def position_table(self, h: int, w: int) -> torch.Tensor:
        """The learned table resampled to an `h x w` grid: `[h * w, hidden]`, row-major."""
        height, width, dim = self.pos_emb.shape
        table = self.pos_emb.reshape(1, height * width, dim)
        table = resample_abs_pos_embed(
            table, [h, w], old_size=[height, width], num_prefix_tokens=0, interpolation="bicubic", antialias=False
        )
        return table[0]

    def forward(self, pixel_values: torch.Tensor, layout: PackLayout) -> torch.Tensor:
        """`[total_tokens, 3, p, p]` (or `[total_tokens, 3 * p * p]`) pixels -> `[total_tokens, hidden]`."""
        weight = self.proj.weight
        x = F.linear(pixel_values.reshape(pixel_values.shape[0], -1).to(weight.dtype), weight.flatten(1),
                     self.proj.bias)
        tables: dict[tuple[int, int], torch.Tensor] = {}
        time = sinusoidal_time_embedding(self.temporal_chunk_size, x.shape[-1], x.device)
        pos = []
        for t, h, w in layout.chunks:
            if (h, w) not in tables:
                tables[(h, w)] = self.position_table(h, w)
            spatial = tables[(h, w)]
            if t == 1:
                pos.append(spatial)
            else:  # [t, h*w, D]: the same spatial table for every frame, plus the frame's sinusoid
                pos.append((spatial[None] + time[:t, None].to(spatial.dtype)).flatten(0, 1))
        return x + torch.cat(pos).to(x.dtype)


class MoonViTRotaryEmbedding(nn.Module):
    """2-D rotary angles from each patch's (row, col); no parameters, computed per forward in fp32."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta

    def forward(self, layout: PackLayout) -> Rope:
        """Returns `(sin, cos)`, each `[total_tokens, 1, head_dim]` fp32 (broadcast over heads)."""
        device = layout.rows.device
        freqs = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim // 2, 2, device=device, dtype=torch.float32) / (self.head_dim // 2)
        )
        angles = torch.stack([layout.cols[:, None] * freqs, layout.rows[:, None] * freqs], dim=-1).flatten(1)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # rotate-half: both halves share the angles
        return angles.sin(), angles.cos()


class MoonViTAttention(MaxLogitRecorder, nn.Module):
    """Multi-head self-attention over a packed sequence with 2-D RoPE; never crosses segment boundaries.

    A QK-Clip target (`kimi_vl.optim_contract.QKClipTarget`, group "vision"): with `record_max_logits = True` (set
    by the optimizer), every forward folds the per-head max pre-softmax logit within its segments
    (`kimi_vl.kernels.packed_max_logits`, scale included) into `max_logits` (`[num_heads]` fp32, element-wise max
    across forwards until reset to None); `qk_clip_row_scales` gives the MHA rule.
    """

    qk_clip_group = "vision"

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope: Rope) -> torch.Tensor:
        """`[total_tokens, hidden]` -> `[total_tokens, hidden]`."""
        sin, cos = rope
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q = apply_rot_embed(q, sin, cos, half=True)
        k = apply_rot_embed(k, sin, cos, half=True)
        if self.record_max_logits:
            self.fold_max_logits(packed_max_logits(q, k, cu_seqlens, self.head_dim**-0.5))
        o = packed_attention(q, k, v, cu_seqlens)
        return self.proj(o.reshape(x.shape[0], -1))

    def qk_clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """QK-Clip's MHA rule for `gamma` `[num_heads]` on the fused `qkv` (`[3 * heads * head_dim, in]`, rows
        ordered q, k, v, head-major): head h's query and key rows of the weight AND the bias by sqrt(gamma[h]);
        value rows untouched. The bias is part of the affine map `q = W_q x + b_q`: with it scaled too, `q_h` and
        `k_h` (and their 2-D rotary images, a linear map per token) scale by exactly sqrt(gamma[h]), so every logit
        of head h scales by gamma[h] for any input. Returns `(parameter, row_scale)` pairs, fp32 CPU row scales."""
        h, d = self.num_heads, self.head_dim
        root = gamma.detach().to(device="cpu", dtype=torch.float32).sqrt()[:, None].expand(h, d).reshape(-1)
        rows = torch.cat([root, root, torch.ones(h * d)])
        return [(p, rows) for p in (self.qkv.weight, self.qkv.bias) if p is not None]


class MoonViTBlock(nn.Module):
    """Pre-norm encoder block: `x + attn(norm1(x))`, then `+ mlp(norm2(.))`."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = MoonViTAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Mlp(config.hidden_size, config.intermediate_size, act_layer=activation(config.hidden_act))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class MoonViTPreTrainedModel(RefusesOffloading, PreTrainedModel):
    config_class = MoonViTConfig
    config: MoonViTConfig
    base_model_prefix = "vision_tower"
    main_input_name = "pixel_values"
    input_modalities = ("image", "video")
    supports_gradient_checkpointing = True
    _no_split_modules = ["MoonViTBlock"]
    _supports_sdpa = True  # packed attention runs F.scaled_dot_product_attention per medium

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, MoonViTPatchEmbed):
            init.trunc_normal_(module.pos_emb, mean=0.0, std=1.0)


class MoonViTModel(MoonViTPreTrainedModel):
    """MoonViT-3D encoder over a pack of images and video clips (see the module docstring)."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__(config)
        self.patch_embed = MoonViTPatchEmbed(config)
        self.rotary_emb = MoonViTRotaryEmbedding(config)
        self.layers = nn.ModuleList(MoonViTBlock(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> MoonViTPatchEmbed:
        """The patch embedding, whose output `[total_patches, hidden]` opens the encoder: transformers'
        `enable_input_require_grads` hooks it, so that adapters inside a frozen encoder get gradients under
        reentrant activation checkpointing."""
        return self.patch_embed

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        """Raise `ShapeError` unless `pixel_values` holds exactly the patches that `grid_thw` describes."""
        p = self.config.patch_size
        kh, kw = self.config.merge_kernel_size
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0 or grid_thw.is_floating_point():
            raise ShapeError(f"grid_thw must be a non-empty integer tensor [num_media, 3]; got {tuple(grid_thw.shape)} "
                             f"{grid_thw.dtype}.")
        if (grid_thw < 1).any() or (grid_thw[:, 1] % kh).any() or (grid_thw[:, 2] % kw).any():
            raise ShapeError(f"every grid_thw row (t, h, w) must be positive with h divisible by {kh} and w by {kw} "
                             f"(merge_kernel_size); got {grid_thw.tolist()}.")
        if pixel_values.shape[1:] not in (torch.Size([3, p, p]), torch.Size([3 * p * p])):
            raise ShapeError(f"pixel_values must be [num_patches, 3, {p}, {p}] or [num_patches, {3 * p * p}]; "
                             f"got {tuple(pixel_values.shape)}.")
        total = int(grid_thw.prod(-1).sum())
        if pixel_values.shape[0] != total:
            raise ShapeError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes {total} "
                             f"(sum of t*h*w over {grid_thw.tolist()}).")

    def merge(self, hidden_states: torch.Tensor, chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        """`[total_tokens, D]` -> `[num_merged, kh*kw, D]`: spatial `kh x kw` groups, mean over each chunk's frames."""
        kh, kw = self.config.merge_kernel_size
        out, start = [], 0
        for t, h, w in chunks:
            seq = hidden_states[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, -1)
            out.append(seq.permute(1, 3, 0, 2, 4, 5).reshape((h // kh) * (w // kw), t, kh * kw, -1).mean(1))
            start += t * h * w
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs) -> BaseModelOutputWithPooling:
        """Encode a pack of media.

        Args:
            pixel_values: `[total_patches, 3, patch, patch]` (or flattened `[total_patches, 3*patch*patch]`), the
                patches of every frame of every medium, row-major within a frame, frames in order.
            grid_thw: `[num_media, 3]` integer `(t, h, w)` in patches; `h`, `w` multiples of `merge_kernel_size`.

        Returns:
            `BaseModelOutputWithPooling` with `last_hidden_state` `[total_patches, hidden]` (after the final
            LayerNorm) and `pooler_output` `[num_merged, kh*kw, hidden]`, where
            `num_merged = sum over chunks of (h/kh)*(w/kw)`.
        """
        self.check_inputs(pixel_values, grid_thw)
        layout = build_layout(split_chunks(grid_thw, self.config.temporal_chunk_size), pixel_values.device)
        x = self.patch_embed(pixel_values, layout)
        rope = self.rotary_emb(layout)
        for layer in self.layers:
            x = run_checkpointed(self, layer, x, layout.cu_seqlens, rope)
        x = self.final_layernorm(x)
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=self.merge(x, layout.chunks))
