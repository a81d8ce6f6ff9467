"""`KimiVLForConditionalGeneration`: early fusion of MoonViT-3D media tokens into the Kimi text backbone.

Images and video chunks are encoded by MoonViT-3D (one packed pass), merged 2x2 (video chunks also averaged over
up to 4 frames), projected to the text width, and written over the embeddings of their placeholder tokens
(`image_token_id` / `video_token_id`) of the one shared sequence, in order; the backbone then sees text and
media tokens alike. Media are encoded at prefill only: decode steps carry no pixels and use the cache.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration import KimiVLConfig
from .errors import InvalidMediaError, ShapeError
from .text import KimiHybridCache, KimiTextForCausalLM
from .text.cache import HybridCacheGenerationMixin
from .vision import MoonViTModel, MoonViTProjector


def scatter_media(
    embeds: torch.Tensor, input_ids: torch.Tensor, token_id: int, features: torch.Tensor, kind: str
) -> torch.Tensor:
    """Write `features [N, hidden]` over the embeddings `[B, T, hidden]` at the N positions where
    `input_ids == token_id` (row-major order); raise `InvalidMediaError` naming both counts on a mismatch."""
    mask = input_ids == token_id
    n = int(mask.sum())
    if n != features.shape[0]:
        raise InvalidMediaError(
            f"the text has {n} {kind} placeholder tokens but the {kind}s give {features.shape[0]} {kind} tokens; "
            f"build inputs with KimiVLProcessor, which expands one placeholder per {kind} into the right count."
        )
    return embeds.masked_scatter(mask[..., None], features.to(embeds.dtype))


class KimiVLPreTrainedModel(PreTrainedModel):
    config_class = KimiVLConfig
    config: KimiVLConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiDeltaAttention", "MultiHeadLatentAttention", "MoE", "SwiGLU", "MoonViTBlock"]
    _supports_sdpa = True
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, MoonViTProjector):
            module.pre_norm.reset_parameters()
            for layer in (module.mlp.fc1, module.mlp.fc2):
                nn.init.normal_(layer.weight, std=self.config.text_config.initializer_range)
                nn.init.zeros_(layer.bias)


class KimiVLForConditionalGeneration(KimiVLPreTrainedModel, HybridCacheGenerationMixin, GenerationMixin):
    """Shapes: `input_ids [B, T]`, `pixel_values [num_patches, 3, 14, 14]` with `image_grid_thw [num_images, 3]`,
    `pixel_values_videos` with `video_grid_thw [num_chunks, 3]` -> `logits [B, T, vocab]`."""

    def __init__(self, config: KimiVLConfig) -> None:
        super().__init__(config)
        v = config.vision_config
        self.vision_tower = MoonViTModel(v)
        kh, kw = v.merge_kernel_size
        self.multi_modal_projector = MoonViTProjector(
            v.hidden_size, kh * kw, config.text_config.hidden_size, config.projector_layer_norm_eps
        )
        self.language_model = KimiTextForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.language_model.get_output_embeddings()

    def media_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged, projected media tokens `[num_merged, text_hidden]` for images or video chunks."""
        vision_dtype = self.vision_tower.patch_embed.proj.weight.dtype
        merged = self.vision_tower(pixel_values.to(vision_dtype), grid_thw).pooler_output
        return self.multi_modal_projector(merged)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.media_features(pixel_values, image_grid_thw)

    def get_video_features(self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.media_features(pixel_values_videos, video_grid_thw)

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings `[B, T, hidden]` with the media tokens written over their placeholders (placeholder ids
        are never looked up: they may lie outside the vocabulary)."""
        placeholders = (input_ids == self.config.image_token_id) | (input_ids == self.config.video_token_id)
        embeds = self.get_input_embeddings()(input_ids.masked_fill(placeholders, 0))
        media = [("image", pixel_values, image_grid_thw, self.config.image_token_id),
                 ("video", pixel_values_videos, video_grid_thw, self.config.video_token_id)]
        for kind, pixels, grid, token_id in media:
            if pixels is None:
                features = embeds.new_zeros(0, embeds.shape[-1])
            elif grid is None:
                raise ShapeError(f"{kind} pixels were given without their grid ({kind}_grid_thw).")
            else:
                features = self.media_features(pixels, grid)
            embeds = scatter_media(embeds, input_ids, token_id, features, kind)
        return embeds

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        past_key_values: KimiHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if inputs_embeds is None:
            if input_ids is None:
                raise ShapeError("Pass input_ids [B, T] (or inputs_embeds [B, T, hidden]).")
            decoding = past_key_values is not None and past_key_values.get_seq_length() > 0
            if decoding and pixel_values is None and pixel_values_videos is None:
                # Decode steps carry no media (they were encoded at prefill); a generated placeholder id is text.
                inputs_embeds = self.get_input_embeddings()(input_ids)
            else:
                inputs_embeds = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                           video_grid_thw)
        elif pixel_values is not None or pixel_values_videos is not None:
            raise ShapeError("Media need input_ids to locate their placeholders; pass input_ids, not inputs_embeds.")
        return self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, past_key_values=past_key_values,
            labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
        )

