"""`MoonViTConfig`: the MoonViT-3D native-resolution vision encoder (and its multimodal projector)."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..errors import ConfigError

# Activation names accepted in `hidden_act` (transformers spelling).
HIDDEN_ACTS = ("gelu_pytorch_tanh", "gelu", "quick_gelu")


class MoonViTConfig(PretrainedConfig):
    r"""Configuration of `MoonViTModel` (model_type `kimi_vl_moonvit`) and `MoonViTProjector`.

    Fields mirror transformers' `Kimi_K25VisionConfig` (defaults = the released Kimi K2.5 vision tower);
    `convert_kimi_k25_vision` fills them from a `kimi_k25` checkpoint.

    Args:
        patch_size: side of the square pixel patches (one token each).
        hidden_size: width of the encoder.
        num_attention_heads: attention heads; `hidden_size / num_attention_heads` must be divisible by 4
            (the 2-D rotary embedding rotates height and width pairs in both halves of the head).
        num_hidden_layers: encoder blocks.
        intermediate_size: width of the MLP in each block.
        hidden_act: MLP activation (`"gelu_pytorch_tanh"` as released, `"gelu"` or `"quick_gelu"`).
        pos_emb_height, pos_emb_width: size of the learned 2-D position table, bicubically resampled to each
            image's patch grid.
        temporal_chunk_size: frames per temporal chunk (transformers' `pos_emb_time`): a clip with more frames
            is split into chunks of this many frames (the last may be shorter); each chunk attends only to itself,
            gets the sinusoidal time embedding of its frames, and is mean-pooled over time in the merge.
        merge_kernel_size: `(kh, kw)` spatial merge of the output patches into one token.
        layer_norm_eps: eps of every LayerNorm in the encoder.
        rope_theta: base of the 2-D rotary embedding.
        initializer_range: std of the normal init of linear and conv weights.
        projector_out_size: output width of `MoonViTProjector` (the language model's hidden size); `None` when
            the checkpoint carries no projector.
        projector_layer_norm_eps: eps of the projector's pre-norm.
    """

    model_type = "kimi_vl_moonvit"

    def __init__(
        self,
        patch_size: int = 14,
        hidden_size: int = 1152,
        num_attention_heads: int = 16,
        num_hidden_layers: int = 27,
        intermediate_size: int = 4304,
        hidden_act: str = "gelu_pytorch_tanh",
        pos_emb_height: int = 64,
        pos_emb_width: int = 64,
        temporal_chunk_size: int = 4,
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        layer_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        initializer_range: float = 0.02,
        projector_out_size: int | None = None,
        projector_layer_norm_eps: float = 1e-5,
        **kwargs,
    ):
        self.patch_size = patch_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.pos_emb_height = pos_emb_height
        self.pos_emb_width = pos_emb_width
        self.temporal_chunk_size = temporal_chunk_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.layer_norm_eps = layer_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.projector_out_size = projector_out_size
        self.projector_layer_norm_eps = projector_layer_norm_eps
        super().__init__(**kwargs)
        self.check_architecture()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_size(self) -> int:
        """Patches per merged token (`kh * kw`)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def check_architecture(self) -> None:
        """Raise `ConfigError` with a fix-it message for any inconsistent field."""
        for name in ("patch_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                     "pos_emb_height", "pos_emb_width", "temporal_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer.")
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ConfigError(
                f"hidden_size={self.hidden_size} must split into num_attention_heads={self.num_attention_heads} "
                "heads whose width is a multiple of 4 (2-D rotary embedding); change either."
            )
        if len(self.merge_kernel_size) != 2 or any(not isinstance(k, int) or k < 1 for k in self.merge_kernel_size):
            raise ConfigError(f"merge_kernel_size={self.merge_kernel_size!r} must be two positive integers (kh, kw).")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act={self.hidden_act!r}; choose one of {sorted(HIDDEN_ACTS)}.")
        if self.projector_out_size is not None and (
            not isinstance(self.projector_out_size, int) or self.projector_out_size < 1
        ):
            raise ConfigError(f"projector_out_size={self.projector_out_size!r} must be a positive integer or None.")
        for name in ("layer_norm_eps", "projector_layer_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0.")
