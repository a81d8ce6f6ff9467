"""kimi-vl: Kimi-style early-fusion vision-text models.

Importing the package registers the Auto classes (`AutoConfig`, `AutoModel`, `AutoModelForCausalLM`,
`AutoModelForImageTextToText`, `AutoProcessor`, `AutoImageProcessor`, `AutoVideoProcessor`).
"""

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoVideoProcessor,
)

from .configuration import KimiVLConfig
from .errors import CheckpointError, ConfigError, InvalidMediaError, KimiVLError, ShapeError
from .modeling import KimiVLForConditionalGeneration
from .processing import KimiVLProcessor
from .text import KimiTextConfig, KimiTextForCausalLM, KimiTextModel
from .vision import MoonViTConfig, MoonViTImageProcessor, MoonViTModel, MoonViTVideoProcessor

AutoConfig.register(KimiTextConfig.model_type, KimiTextConfig, exist_ok=True)
AutoModel.register(KimiTextConfig, KimiTextModel, exist_ok=True)
AutoModelForCausalLM.register(KimiTextConfig, KimiTextForCausalLM, exist_ok=True)
AutoConfig.register(MoonViTConfig.model_type, MoonViTConfig, exist_ok=True)
AutoModel.register(MoonViTConfig, MoonViTModel, exist_ok=True)
AutoImageProcessor.register(MoonViTConfig, fast_image_processor_class=MoonViTImageProcessor, exist_ok=True)
AutoVideoProcessor.register(MoonViTConfig, MoonViTVideoProcessor, exist_ok=True)
AutoConfig.register(KimiVLConfig.model_type, KimiVLConfig, exist_ok=True)
AutoModelForImageTextToText.register(KimiVLConfig, KimiVLForConditionalGeneration, exist_ok=True)
AutoModelForCausalLM.register(KimiVLConfig, KimiVLForConditionalGeneration, exist_ok=True)  # as `export`'s auto_map
AutoProcessor.register(KimiVLConfig, KimiVLProcessor, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InvalidMediaError",
    "KimiTextConfig",
    "KimiVLConfig",
    "KimiVLForConditionalGeneration",
    "KimiVLProcessor",
    "KimiTextForCausalLM",
    "KimiTextModel",
    "KimiVLError",
    "MoonViTConfig",
    "MoonViTImageProcessor",
    "MoonViTModel",
    "MoonViTVideoProcessor",
    "ShapeError",
]
