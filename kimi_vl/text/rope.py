"""Rotary position embedding of RoPE-MLA layers (`layer_types` entry `"mla_rope"`, the DeepSeek-V3 / Kimi K2 layout).

Only the `qk_rope_head_dim` slice of each query head and the one key slice shared by all heads rotate; the rest of
MLA (the latent, `q_nope`/`k_nope`, values) has no position. The rotation uses the half-split layout (dimension `i`
pairs with `i + d/2`); checkpoints that store the rope rows interleaved (`rope_interleave=True`, DeepSeek's own
layout, pairs `(2i, 2i+1)`) are permuted at conversion time (`kimi_vl.convert`), which gives identical logits.

`rope_parameters` uses transformers' names: `rope_type` and `rope_theta`, plus per type

- `"default"`: nothing else;
- `"linear"`: `factor` (positions divided by it);
- `"yarn"` (DeepSeek-V3, Kimi K2): `factor` (None: `max_position_embeddings / original_max_position_embeddings`),
  `original_max_position_embeddings`, optional `beta_fast` (32), `beta_slow` (1), `truncate` (True),
  `attention_factor` (else `m(factor, mscale) / m(factor, mscale_all_dim)` when both are given, else
  `m(factor, 1)`, with `m(s, k) = 0.1 k ln s + 1` for `s > 1`, else 1), `mscale`, `mscale_all_dim`;
- `"llama3"`: `factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`.

Two scalings come with the scaled types, as in DeepSeek-V3: `attention_factor` multiplies cos and sin (so the rope
part of every logit by its square), and, when `mscale_all_dim` is set on a non-default type, the softmax scale of
RoPE-MLA layers is multiplied by `m(factor, mscale_all_dim) ** 2` (`softmax_scale_multiplier`).
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def _mscale(scale: float, coefficient: float = 1.0) -> float:
    """YaRN's attention temperature `0.1 * coefficient * ln(scale) + 1` (1 for `scale <= 1`)."""
    return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """`1 / theta^(2i/dim)` for `i < dim/2`, in fp32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def _factor(params: dict, max_position_embeddings: int | None) -> float:
    factor = params.get("factor")
    if factor is None and params.get("rope_type") == "yarn" and max_position_embeddings:
        factor = max_position_embeddings / params["original_max_position_embeddings"]
    if factor is None:
        raise ConfigError(f"rope_parameters {params} need a 'factor' for rope_type={params.get('rope_type')!r}.")
    return float(factor)


def check_rope_parameters(params: dict, dim: int, max_position_embeddings: int | None) -> None:
    """Raise `ConfigError` naming the field when `params` cannot drive a rotary embedding of width `dim`."""
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_parameters has rope_type={kind!r}; kimi-vl's RoPE-MLA supports {ROPE_TYPES}.")
    if not isinstance(params.get("rope_theta"), (int, float)) or params["rope_theta"] <= 0:
        raise ConfigError(f"rope_parameters needs a positive 'rope_theta'; got {params.get('rope_theta')!r}.")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("rope_parameters.partial_rotary_factor must be 1: RoPE-MLA rotates the whole "
                          "qk_rope_head_dim slice.")
    if dim % 2:
        raise ConfigError(f"qk_rope_head_dim={dim} must be even for RoPE-MLA layers (dimensions rotate in pairs).")
    needed = {"linear": ("factor",), "yarn": ("original_max_position_embeddings",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(kind, ()) if params.get(k) is None]
    if missing:
        raise ConfigError(f"rope_parameters of rope_type={kind!r} lack {missing}.")
    if kind == "yarn":
        _factor(params, max_position_embeddings)


def rope_frequencies(params: dict, dim: int, max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim / 2]` (fp32) and the cos/sin multiplier (`attention_factor`) for `params`."""
    check_rope_parameters(params, dim, max_position_embeddings)
    kind, theta = params.get("rope_type", "default"), float(params["rope_theta"])
    inv_freq = _base_inv_freq(theta, dim)
    if kind == "default":
        return inv_freq, 1.0
    factor = _factor(params, max_position_embeddings)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        original = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(medium, blended, scaled), 1.0
    # yarn: interpolate the low frequencies (long wavelengths) by `factor`, keep the high ones, ramp in between.
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale_multiplier(params: dict, max_position_embeddings: int | None = None) -> float:
    """DeepSeek-V3's YaRN temperature on the softmax scale: `m(factor, mscale_all_dim) ** 2` for a non-default
    rope type with `mscale_all_dim` set, else 1."""
    if params.get("rope_type", "default") == "default" or not params.get("mscale_all_dim"):
        return 1.0
    return _mscale(_factor(params, max_position_embeddings), params["mscale_all_dim"]) ** 2


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., d]` by the angles whose `cos`/`sin` broadcast against it (half-split pairs)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding:
    """cos/sin `[B, T, d]` for position ids `[B or 1, T]` (angles in fp32, cast to the activations' dtype).

    Not an `nn.Module` buffer: the inverse frequencies are a pure function of the config, computed on the CPU (also
    when the model is built under a meta-device context) and copied per device (a non-persistent buffer would be
    left uninitialised by `from_pretrained`'s meta-device loading).
    """

    def __init__(self, params: dict, dim: int, max_position_embeddings: int | None = None) -> None:
        self.inv_freq, self.attention_factor = rope_frequencies(params, dim, max_position_embeddings)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        inv_freq = self._on_device.get(device)
        if inv_freq is None:
            inv_freq = self._on_device[device] = self.inv_freq.to(device)
        angles = position_ids[..., None].float() * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)


def packed_positions(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Positions `[1, length]` restarting at 0 at every packed-sequence boundary of `cu_seqlens` `[N + 1]`."""
    idx = torch.arange(length, device=cu_seqlens.device)
    bounds = cu_seqlens.to(device=idx.device, dtype=torch.long)
    seg = (torch.searchsorted(bounds[1:], idx, right=True)).clamp(max=bounds.numel() - 2)
    return (idx - bounds[seg])[None]
