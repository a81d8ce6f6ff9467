"""The Kimi-Linear language backbone: KDA + NoPE MLA hybrid with MoE feed-forward."""

from .cache import KimiHybridCache
from .configuration import KimiTextConfig
from .modeling import KimiTextForCausalLM, KimiTextModel, KimiTextPreTrainedModel

__all__ = ["KimiHybridCache", "KimiTextConfig", "KimiTextForCausalLM", "KimiTextModel", "KimiTextPreTrainedModel"]
