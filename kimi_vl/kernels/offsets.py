"""Packed-sequence offsets (`cu_seqlens`) on the host, read back once per tensor.

Every packed layer needs `cu_seqlens` as Python ints (to validate them, split the pack, lay out chunks), and
`tensor.tolist()` on a CUDA tensor waits for every kernel queued before it. The layers of one forward share one
`cu_seqlens` tensor (the text model's, the vision tower's), so `host_offsets` keeps the lists of the last few tensors
it read: one wait per tensor instead of one per layer (and per recomputed layer in the backward).
"""

from __future__ import annotations

import torch

_KEEP = 4
_cache: list[tuple[torch.Tensor, int, list[int]]] = []  # (tensor, its version, its offsets), newest last


def host_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """`cu_seqlens` `[N + 1]` as a list of ints. The same tensor object, unchanged since (its in-place version
    counter), gives the list read before without touching the device; the cache holds the tensors it keys on, so an
    id is never reused while cached. A write that bypasses the counter (through `.numpy()` or `.data`) is not
    seen: give changed offsets as a new tensor. Inference tensors (made under `torch.inference_mode`) have no
    version counter: they are read every time."""
    if cu_seqlens.is_inference():
        return [int(x) for x in cu_seqlens.tolist()]
    for tensor, version, offsets in _cache:
        if tensor is cu_seqlens and version == cu_seqlens._version:
            return offsets
    offsets = [int(x) for x in cu_seqlens.tolist()]
    _cache.append((cu_seqlens, cu_seqlens._version, offsets))
    del _cache[:-_KEEP]
    return offsets


__all__ = ["host_offsets"]
