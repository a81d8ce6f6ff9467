"""kimi-vl: Kimi-style early-fusion vision-text models.

Importing the package registers the Auto classes (`AutoConfig`, `AutoModel`, `AutoModelForCausalLM`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .errors import CheckpointError, ConfigError, InvalidMediaError, KimiVLError, ShapeError
from .text import KimiTextConfig, KimiTextForCausalLM, KimiTextModel

AutoConfig.register(KimiTextConfig.model_type, KimiTextConfig, exist_ok=True)
AutoModel.register(KimiTextConfig, KimiTextModel, exist_ok=True)
AutoModelForCausalLM.register(KimiTextConfig, KimiTextForCausalLM, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InvalidMediaError",
    "KimiTextConfig",
    "KimiTextForCausalLM",
    "KimiTextModel",
    "KimiVLError",
    "ShapeError",
]
