"""`KimiVLForConditionalGeneration`: MoonViT-3D, its projector and the Kimi text backbone, fused early
(`kimi_vl.fusion`): media tokens are written over their placeholders in the one shared sequence, so the backbone
sees text and media tokens alike. Media are encoded at prefill only: decode steps carry no pixels and use the cache.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import can_return_tuple

from .configuration import KimiVLConfig
from .errors import InvalidMediaError, ShapeError
from .fusion.embedding import fuse_media, media_tokens, repeat_media_per_sample
from .offloading import RefusesOffloading
from .text import KimiHybridCache, KimiTextForCausalLM, KimiTextModel
from .text.cache import HybridCacheGenerationMixin
from .text.modeling import one_cache, real_tokens, refuse_attention_outputs
from .vision import MoonViTModel, MoonViTProjector


class KimiVLPreTrainedModel(RefusesOffloading, PreTrainedModel):
    config_class = KimiVLConfig
    config: KimiVLConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiDeltaAttention", "MultiHeadLatentAttention", "MoE", "SwiGLU", "MoonViTBlock"]
    _supports_sdpa = True
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing here: the tower and the language model initialise their modules themselves (their own
        `_init_weights`), and the projector's layers keep PyTorch's initialisation from their construction (what
        transformers' default init would overwrite). transformers hands this method only those layers, never the
        projector whole; `from_pretrained` re-runs their construction-time init when it finds no weights for them."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' `from_pretrained`; a checkpoint without the projector's weights (a tower and a language model
        put together by hand) gets the projector a freshly constructed model has, instead of the uninitialised memory
        transformers leaves in layers that `_init_weights` does not set."""
        with_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if any(key.startswith("multi_modal_projector.") for key in info["missing_keys"]):
            with torch.no_grad():
                for layer in model.multi_modal_projector.modules():
                    if hasattr(layer, "reset_parameters"):
                        layer.reset_parameters()
        return (model, info) if with_info else model


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

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.language_model.set_output_embeddings(value)

    def get_decoder(self) -> KimiTextModel:
        """The text backbone without its LM head (`input_ids [B, T]` -> `last_hidden_state [B, T, hidden]`), as
        transformers' vision-language models return it; their `language_model` is that backbone, ours holds the
        head too (transformers' default lookup returned it)."""
        return self.language_model.get_decoder()

    def set_decoder(self, decoder: KimiTextModel) -> None:
        self.language_model.model = decoder

    def media_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged, projected media tokens `[num_merged, text_hidden]` for images or video chunks."""
        return media_tokens(self.vision_tower, self.multi_modal_projector, pixel_values, grid_thw)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.media_features(pixel_values, image_grid_thw)

    def get_video_features(self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.media_features(pixel_values_videos, video_grid_thw)

    def media_token_counts(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """`[n]` merged tokens (placeholders) of each `(t, h, w)` row of `grid_thw [n, 3]`: `(h / kh) * (w / kw)`
        per temporal chunk of up to `temporal_chunk_size` frames."""
        v = self.config.vision_config
        kh, kw = v.merge_kernel_size
        t, h, w = grid_thw.long().unbind(-1)
        return (-(-t // v.temporal_chunk_size)) * (h // kh) * (w // kw)

    def _expand_inputs_for_generation(
        self,
        expand_size: int = 1,
        is_encoder_decoder: bool = False,
        input_ids: torch.LongTensor | None = None,
        **model_kwargs,
    ) -> tuple[torch.LongTensor | None, dict]:
        """transformers' expansion of the batch for `num_return_sequences` and beam search, with the media repeated
        per sample (`repeat_media_per_sample`): media tensors have one row per patch and per grid, not per sample,
        so transformers' `repeat_interleave` of every tensor would hand each copy of a sample other pixels.

        With a cache continued (a next turn), the media are those of the ids it has not read: `input_ids` past its
        length when they hold the whole conversation (an `attention_mask` as long as them), else all of them."""
        media = {}
        if expand_size > 1 and input_ids is not None:
            cache, mask = model_kwargs.get("cache"), model_kwargs.get("attention_mask")
            seen = cache.get_seq_length() if cache is not None else 0
            new_ids = input_ids[:, seen:] if mask is None or mask.shape[1] == input_ids.shape[1] else input_ids
            for kind, token_id, pixels_key, grid_key in (
                ("image", self.config.image_token_id, "pixel_values", "image_grid_thw"),
                ("video", self.config.video_token_id, "pixel_values_videos", "video_grid_thw"),
            ):
                pixels, grid = model_kwargs.get(pixels_key), model_kwargs.get(grid_key)
                if pixels is not None and grid is not None:
                    del model_kwargs[pixels_key], model_kwargs[grid_key]
                    media[pixels_key], media[grid_key] = repeat_media_per_sample(
                        new_ids == token_id, pixels, grid, self.media_token_counts(grid), expand_size, kind
                    )
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        return input_ids, {**model_kwargs, **media}

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings `[B, T, hidden]` with the media tokens written over their placeholders (placeholder ids
        are never looked up: they may lie outside the vocabulary).

        Under FSDP2 (`fully_shard`) every rank gathers and reduces the vision tower's shards together, in every
        forward and backward: a kind of media (image, video) this call lacks runs on one blank grid and adds exactly
        zero, so the tower runs as often on every rank whatever its data (a text-only batch or rollout share)."""
        media = [(self.config.image_token_id, pixel_values, image_grid_thw),
                 (self.config.video_token_id, pixel_values_videos, video_grid_thw)]
        embeds = fuse_media(self.get_input_embeddings(), input_ids, media, self.media_features)
        if isinstance(self, FSDPModule):
            v = self.config.vision_config
            kh, kw = v.merge_kernel_size
            for _, pixels, _ in media:
                if pixels is None:
                    blank = embeds.new_zeros(kh * kw, 3, v.patch_size, v.patch_size)
                    grid = torch.tensor([[1, kh, kw]], device=embeds.device)
                    embeds = embeds + 0 * self.media_features(blank, grid).sum()
        return embeds

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        cache: KimiHybridCache | None = None,
        past_key_values: KimiHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`output_hidden_states` and `output_attentions` default to this model's `config` (as in transformers'
        models), else to `text_config`'s; see `KimiTextModel.forward`."""
        refuse_attention_outputs(kwargs, self.config)
        if kwargs.get("output_hidden_states") is None and self.config.output_hidden_states:
            kwargs["output_hidden_states"] = True
        cache = one_cache(cache, past_key_values)
        if inputs_embeds is None:
            if input_ids is None or input_ids.dim() != 2:
                got = "none" if input_ids is None else f"shape {tuple(input_ids.shape)}"
                raise ShapeError(f"Pass input_ids [B, T] (or inputs_embeds [B, T, hidden]), got {got}; a single "
                                 "sequence is ids[None].")
            decoding = cache is not None and cache.get_seq_length() > 0
            if decoding and pixel_values is None and pixel_values_videos is None:
                # Decode steps carry no media (they were encoded at prefill); a generated placeholder id is text.
                inputs_embeds = self.get_input_embeddings()(input_ids)
            else:
                try:
                    inputs_embeds = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                               video_grid_thw)
                except InvalidMediaError as e:
                    if not decoding:
                        raise
                    raise InvalidMediaError(
                        f"{e} This call continues a cache of {cache.get_seq_length()} tokens, whose media were "
                        "encoded when those tokens were read: pass only the media of the new tokens (a next turn: "
                        "its own images, or none), not the whole conversation's."
                    ) from e
        elif pixel_values is not None or pixel_values_videos is not None:
            raise ShapeError("Media need input_ids to locate their placeholders; pass input_ids, not inputs_embeds.")
        if self.training and input_ids is not None and kwargs.get("token_mask") is None:
            # the language model sees embeddings only: its routers learn which tokens are padding from the ids here
            kwargs["token_mask"] = real_tokens(input_ids, attention_mask, self.config.text_config.pad_token_id,
                                               input_ids.shape[1])
        return self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, return_dict=True, **kwargs,
        )

