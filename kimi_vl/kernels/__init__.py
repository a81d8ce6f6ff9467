"""Pure tensor ops: Kimi Delta Attention (KDA), the short causal convolution and packed varlen attention.

KDA has three paths behind one signature: the token-by-token reference (`naive_recurrent_kda`), the torch path
(chunked WY/UT transform; used for CPU tensors) and Triton kernels (`kda_triton`; used for CUDA tensors).
`naive_chunk_kda` is the chunked algorithm written plainly (one chunk at a time), a reference beside the fast path.
`KIMI_VL_KERNELS=reference|torch|triton` forces one (triton on CPU needs `TRITON_INTERPRET=1`).
"""

from kimi_vl.kernels.attention import packed_attention
from kimi_vl.kernels.conv import causal_conv1d
from kimi_vl.kernels.kda import chunk_kda, fused_recurrent_kda, l2norm, naive_chunk_kda, naive_recurrent_kda

__all__ = ["causal_conv1d", "chunk_kda", "fused_recurrent_kda", "l2norm", "naive_chunk_kda",
           "naive_recurrent_kda", "packed_attention"]
