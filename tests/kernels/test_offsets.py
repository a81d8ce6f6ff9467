"""`host_offsets`: a packed forward reads its `cu_seqlens` back from the device once, not once per layer."""

from __future__ import annotations

import torch

from kimi_vl.kernels.offsets import host_offsets


def _count_reads(monkeypatch) -> list[int]:
    """Patch `Tensor.tolist` to record the id of every tensor read back; returns the record."""
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(id(self)) or tolist(self))
    return reads


def test_the_same_unchanged_tensor_is_read_once(monkeypatch):
    reads = _count_reads(monkeypatch)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert host_offsets(cu) == [0, 3, 7] and host_offsets(cu) == [0, 3, 7]
    assert reads == [id(cu)]
    cu[1] = 4  # in place: the version counter moves, the offsets are read again
    assert host_offsets(cu) == [0, 4, 7] and len(reads) == 2
    other = torch.tensor([0, 4, 7], dtype=torch.int32)  # equal values, another tensor: read, never assumed
    assert host_offsets(other) == [0, 4, 7] and len(reads) == 3


def test_a_packed_forward_reads_its_offsets_once(monkeypatch):
    """The tiny text model (KDA and MLA layers, short convolutions, QK-Clip's max logits) on 3 packed sequences."""
    from tests.text.test_model import tiny_model

    model = tiny_model()
    for m in model.modules():
        if hasattr(m, "record_max_logits"):
            m.record_max_logits = True
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    ids = torch.randint(3, model.config.vocab_size, (1, 20))
    reads = _count_reads(monkeypatch)
    model(ids, labels=ids, cu_seqlens=cu).loss.backward()
    assert reads.count(id(cu)) == 1


def test_the_triton_chunk_layout_is_copied_once_per_offsets_list():
    """The Triton path's offsets and chunk table (one host-to-device copy) are reused for the same offsets list,
    which `host_offsets` hands every layer of a forward; an equal but new list is laid out afresh. Each part starts
    on 16 bytes."""
    from kimi_vl.kernels.kda_triton import CHUNK, _chunk_layout

    offsets = [0, 5, 5 + CHUNK + 1, 200]
    cu, chunks, first = _chunk_layout(offsets, torch.device("cpu"))
    assert cu.tolist() == offsets and first.tolist() == [0, 1, 3]
    assert chunks.tolist() == [[0, 5], [5, 5 + CHUNK], [5 + CHUNK, 6 + CHUNK], [6 + CHUNK, 6 + 2 * CHUNK],
                               [6 + 2 * CHUNK, 6 + 3 * CHUNK], [6 + 3 * CHUNK, 200]]
    assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in (cu, chunks, first))
    assert all(a is b for a, b in zip(_chunk_layout(offsets, torch.device("cpu")), (cu, chunks, first)))
    assert _chunk_layout(list(offsets), torch.device("cpu"))[0] is not cu


def test_offsets_made_under_inference_mode_are_read_each_time():
    """Inference tensors have no version counter: `cu_seqlens` built under `torch.inference_mode` (as the vision
    tower builds its pack inside the forward) is read, and read again after an in-place change, never cached."""
    from kimi_vl.kernels import chunk_kda

    with torch.inference_mode():
        cu = torch.tensor([0, 2, 5])
        assert host_offsets(cu) == [0, 2, 5]
        cu[1] = 3
        assert host_offsets(cu) == [0, 3, 5]
        q = torch.randn(1, 5, 1, 4)
        o, _ = chunk_kda(q, q, q, -torch.ones_like(q), torch.ones(1, 5, 1), cu_seqlens=cu)
    assert o.shape == (1, 5, 1, 4)
