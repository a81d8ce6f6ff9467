"""The Kimi language backbone: the Kimi-Linear KDA + NoPE MLA hybrid with MoE feed-forward, and (RoPE-MLA layers,
low-rank queries, grouped routing) the DeepSeek-V3 / Kimi K2 text model as a configuration of the same classes."""

from .cache import KimiHybridCache
from .configuration import KimiTextConfig
from .modeling import KimiTextForCausalLM, KimiTextModel, KimiTextPreTrainedModel

__all__ = ["KimiHybridCache", "KimiTextConfig", "KimiTextForCausalLM", "KimiTextModel", "KimiTextPreTrainedModel"]
