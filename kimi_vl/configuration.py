"""`KimiVLConfig`: the early-fusion model = MoonViT-3D vision config + Kimi text config + fusion fields."""

from __future__ import annotations

from transformers import PretrainedConfig

from .errors import ConfigError
from .text.configuration import KimiTextConfig
from .vision.configuration import MoonViTConfig

TEXT_FIELDS = ("tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")
"""Fields of `KimiVLConfig` that are `text_config`'s: the language model ties its head and finds padding by its own
config."""


class KimiVLConfig(PretrainedConfig):
    r"""Configuration of `KimiVLForConditionalGeneration` (model_type `kimi_vl`).

    Args:
        vision_config: a `MoonViTConfig` (or its dict).
        text_config: a `KimiTextConfig` (or its dict).
        image_token_id: id of `<|media_pad|>`, the placeholder each merged image token replaces.
        video_token_id: id of the video placeholder, one per merged token of each video chunk.
            Placeholder ids may lie outside the text vocabulary (transformers' `kimi_k25` puts its video
            placeholder at id 163840, just past K2.5's 163840-token vocabulary): placeholders are never embedded,
            their positions always receive media features.
        projector_layer_norm_eps: eps of the projector's LayerNorm over each patch.
        vision_start_token_id, vision_end_token_id: ids of `<|media_start|>` / `<|media_end|>`, the tokens around
            each media's placeholders (informational: carried over from `kimi_k25` checkpoints, None otherwise).
        tie_word_embeddings, pad_token_id, bos_token_id, eos_token_id: default `text_config`'s; a value given here, or
            set on this config later (as `from_pretrained(path, tie_word_embeddings=True)` does), is written into
            `text_config` too (the language model ties its LM head and tells padding by its own config).
    """

    model_type = "kimi_vl"
    sub_configs = {"vision_config": MoonViTConfig, "text_config": KimiTextConfig}
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vision_config: MoonViTConfig | dict | None = None,
        text_config: KimiTextConfig | dict | None = None,
        image_token_id: int = 163605,
        video_token_id: int = 163606,
        projector_layer_norm_eps: float = 1e-5,
        vision_start_token_id: int | None = None,
        vision_end_token_id: int | None = None,
        **kwargs,
    ):
        if isinstance(vision_config, dict):
            vision_config = MoonViTConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        if isinstance(text_config, dict):
            text_config = KimiTextConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
        self.vision_config = vision_config if vision_config is not None else MoonViTConfig()
        self.text_config = text_config if text_config is not None else KimiTextConfig()
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.projector_layer_norm_eps = projector_layer_norm_eps
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        for name in TEXT_FIELDS:  # a value given here reaches text_config through `__setattr__`
            kwargs.setdefault(name, getattr(self.text_config, name))
        super().__init__(**kwargs)
        for name in ("image_token_id", "video_token_id"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a non-negative integer: the tokenizer's id "
                                  "of the placeholder token.")
        if image_token_id == video_token_id:
            raise ConfigError("image_token_id and video_token_id must differ (images and videos are scattered "
                              "separately).")

    def __setattr__(self, name: str, value) -> None:
        """`TEXT_FIELDS` set on this config are set on `text_config` too (transformers' `from_pretrained` and
        `from_dict` set their keyword overrides as attributes after construction)."""
        super().__setattr__(name, value)
        if name in TEXT_FIELDS and "text_config" in self.__dict__:
            setattr(self.text_config, name, value)
