"""`MoonViTProjector`: merged MoonViT patches -> language-model embeddings, weight-compatible with transformers'
`Kimi_K25MultimodalProjection` (`pre_norm` -> `in_proj` = `mlp.fc1`, exact GELU, `out_proj` = `mlp.fc2`).

The MLP is `timm.layers.Mlp`. `convert_kimi_k25_vision` writes `projector.safetensors` next to the MoonViT
weights and the projector fields into the MoonViT `config.json`; `MoonViTProjector.from_pretrained(dir)` loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from timm.layers import Mlp
from torch import nn

from ..errors import CheckpointError, ConfigError, ShapeError
from .configuration import MoonViTConfig

PROJECTOR_WEIGHTS = "projector.safetensors"


class MoonViTProjector(nn.Module):
    """LayerNorm over each patch, concatenation of the `kh*kw` patches of a merged token, then a 2-layer MLP.

    Args:
        vision_hidden_size: width of the MoonViT patches.
        merge_size: patches per merged token (`kh * kw`).
        out_size: output width (the language model's hidden size).
        layer_norm_eps: eps of `pre_norm`.
    """

    def __init__(self, vision_hidden_size: int, merge_size: int, out_size: int, layer_norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.merge_size = merge_size
        width = vision_hidden_size * merge_size
        self.pre_norm = nn.LayerNorm(vision_hidden_size, eps=layer_norm_eps)
        self.mlp = Mlp(width, width, out_size, act_layer=nn.GELU)

    @classmethod
    def from_config(cls, config: MoonViTConfig) -> MoonViTProjector:
        """A randomly initialised projector for `config` (which must set `projector_out_size`)."""
        if config.projector_out_size is None:
            raise ConfigError("config.projector_out_size is None: this MoonViT config has no projector; set it to the "
                              "language model's hidden size.")
        return cls(config.hidden_size, config.merge_size, config.projector_out_size, config.projector_layer_norm_eps)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> MoonViTProjector:
        """Load the projector written by `convert_kimi_k25_vision` (`config.json` + `projector.safetensors`)."""
        directory = Path(directory)
        weights = directory / PROJECTOR_WEIGHTS
        if not weights.is_file():
            raise CheckpointError(f"{weights} not found: the directory holds no projector (convert a full kimi_k25 "
                                  "checkpoint, not a bare vision tower, to get one).")
        projector = cls.from_config(MoonViTConfig.from_pretrained(directory))
        state = load_file(weights)
        missing, unexpected = projector.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{weights} does not match the projector: missing {missing}, unexpected {unexpected}."
            )
        return projector

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """`[num_merged, kh*kw, vision_hidden]` (MoonViT `pooler_output`) -> `[num_merged, out_size]`."""
        dim = self.pre_norm.normalized_shape[0]
        if merged.dim() != 3 or merged.shape[1] != self.merge_size or merged.shape[2] != dim:
            raise ShapeError(
                f"expected merged patches [num_merged, {self.merge_size}, {dim}]; got {tuple(merged.shape)}."
            )
        return self.mlp(self.pre_norm(merged).flatten(1))
