"""Sequence-mixing kernels: Kimi Delta Attention (KDA) ops and the short causal convolution.

Pure-PyTorch implementations. Set ``KIMI_VL_KERNELS=reference`` to route :func:`chunk_kda` and
:func:`fused_recurrent_kda` through the token-by-token reference (``torch``, the default, uses the
chunked / vectorised paths).
"""

from kimi_vl.kernels.attention import packed_attention
from kimi_vl.kernels.conv import causal_conv1d
from kimi_vl.kernels.kda import chunk_kda, fused_recurrent_kda, l2norm, naive_recurrent_kda

__all__ = ["causal_conv1d", "chunk_kda", "fused_recurrent_kda", "l2norm", "naive_recurrent_kda", "packed_attention"]
