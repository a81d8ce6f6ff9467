"""Decoding with the hybrid cache: the random (synthetic) cache has a real prefill's tensors, `generate` allocates
the cache once, and its decode steps give the tokens of cache-free decoding."""

import pytest
import torch

from kimi_vl.text import KimiHybridCache

from .test_model import tiny_model

LAYOUTS = {
    "hybrid": ["kda", "kda", "kda", "mla"],
    "all-MLA": ["mla"] * 4,
    "rope mix": ["kda", "mla_rope", "kda", "mla"],
}
ROPE = {"rope_type": "default", "rope_theta": 1000.0}


def layout_model(name: str):
    return tiny_model(layer_types=LAYOUTS[name], rope_parameters=ROPE)


def cache_tensors(cache: KimiHybridCache) -> list[tuple]:
    """(layer, kind, shape, dtype, contiguous) of every tensor decoding reads (latents: the cached rows)."""
    out = []
    n = cache.get_seq_length()
    for i in range(len(cache)):
        for kind, t in (("state", cache.recurrent_states[i]), ("tail", cache.conv_tails[i]),
                        ("latent", None if cache._latents[i] is None else cache._latents[i][:, :n])):
            if t is not None:
                out.append((i, kind, tuple(t.shape), t.dtype, t.is_contiguous()))
    return out


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_cache_has_the_tensors_of_a_real_prefill(layout, dtype):
    model = layout_model(layout).to(dtype)
    real = KimiHybridCache(model.config)
    model(torch.randint(3, 61, (2, 37)), cache=real)
    fake = KimiHybridCache.random(model.config, 37, batch_size=2, dtype=dtype, max_length=40,
                                  generator=torch.Generator().manual_seed(0))
    assert cache_tensors(fake) == cache_tensors(real)
    assert fake.get_seq_length() == real.get_seq_length() == 37
    assert fake.nbytes() == real.nbytes()
    for _ in range(3):  # the model decodes from it, in place (no reallocation within max_length)
        logits = model(torch.tensor([[5], [6]]), cache=fake).logits
        assert torch.isfinite(logits).all()
    assert fake.get_seq_length() == 40
    assert all(b is None or b.shape[1] == 40 for b in fake._latents)


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generate_equals_cache_free_decoding(layout):
    """`generate`'s decode steps (preallocated cache, recurrent KDA, absorbed MLA) give the tokens of repeated
    cache-free forwards, on a left-padded batch."""
    model = layout_model(layout)
    ids = torch.randint(3, 61, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         eos_token_id=None, return_dict_in_generate=True)
    seq, m = ids, mask
    for _ in range(12):
        nxt = model(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(out.sequences, seq)
    # The cache was allocated once for prompt + new tokens (the last token is never fed back), not grown.
    cache = out.cache
    assert cache.get_seq_length() == 21 + 11
    assert {b.shape[1] for b in cache._latents if b is not None} == {21 + 11}
