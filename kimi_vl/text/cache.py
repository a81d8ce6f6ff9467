"""`KimiHybridCache`: the inference state of the hybrid backbone, as a `transformers.Cache`.

Per KDA layer: the fp32 recurrent state `[B, H, Dk, Dv]` and the conv tail `[B, 3*H*Dk, kernel-1]` (constant
size, whatever the context length). Per MLA layer (NoPE or RoPE): the compressed latent
`[B, L, kv_lora_rank + qk_rope_head_dim]` (normalised latent + shared key slice, rotated in RoPE layers), stored in
a buffer allocated once for `max_length` tokens when that is known (`generate` passes prompt + new tokens), else
grown by doubling, so decoding never copies the whole context every step.

`KimiHybridCache.random` builds the state a prefill of any length leaves, with random values, without running it:
long-context decode benchmarks read exactly what a real prefill would have written, through the same decode code.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..errors import KimiVLError, ShapeError
from .configuration import KimiTextConfig


class KimiHybridCache(Cache):
    """Cache of `KimiTextModel`; `generate()` creates one automatically.

    The model calls `update_kda` / `update_latent` per layer and `advance(n)` once per forward. `max_length`: the
    tokens the cache will hold (prompt + generated); MLA buffers are then allocated once at that size (pages are
    only touched as tokens are written) instead of growing by doubling.
    """

    is_compileable = False

    def __init__(self, config: KimiTextConfig, max_length: int | None = None) -> None:
        super().__init__(layers=[])
        self.config = config
        self.max_length = max_length
        self.layer_types = list(config.layer_types)
        n = config.num_hidden_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * n
        self.conv_tails: list[torch.Tensor | None] = [None] * n
        self._latents: list[torch.Tensor | None] = [None] * n
        self._seen_tokens = 0

    # --- what the layers use -------------------------------------------------------------------------------------
    def update_kda(self, layer_idx: int, state: torch.Tensor, tail: torch.Tensor) -> None:
        self.recurrent_states[layer_idx] = state
        self.conv_tails[layer_idx] = tail

    def update_latent(self, layer_idx: int, latent: torch.Tensor) -> torch.Tensor:
        """Append `latent` `[B, T, r + dr]` and return the whole cached latent `[B, L, r + dr]` (a view)."""
        buf = self._latents[layer_idx]
        start = self._seen_tokens
        end = start + latent.shape[1]
        if buf is None or buf.shape[1] < end:
            cap = max(end, 2 * (buf.shape[1] if buf is not None else 0), self.max_length or 64)
            new = latent.new_empty(latent.shape[0], cap, latent.shape[2])
            if buf is not None:
                new[:, :start] = buf[:, :start]
            buf = self._latents[layer_idx] = new
        buf[:, start:end] = latent
        return buf[:, :end]

    def advance(self, num_tokens: int) -> None:
        self._seen_tokens += num_tokens

    @classmethod
    def random(
        cls,
        config: KimiTextConfig,
        num_tokens: int,
        *,
        batch_size: int = 1,
        max_length: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> KimiHybridCache:
        """The cache a prefill of `num_tokens` tokens leaves, with random values in place of computed ones.

        Same tensors, shapes and dtypes as a real prefill of a model in `dtype` (`tests/text`): per KDA layer an fp32
        recurrent state `[B, H, Dk, Dv]` (fp64 for fp64 models) and a conv tail `[B, 3*H*Dk, kernel-1]` in `dtype`;
        per MLA layer (NoPE and RoPE alike) `num_tokens` latent rows `[c ; k_pe]` in `dtype`, in a buffer of
        `max_length` rows (default `num_tokens + 256`; decoding past it reallocates). Every buffer is allocated once
        and filled in place.
        """
        cache = cls(config, max_length=max(max_length or num_tokens + 256, num_tokens))
        h, dk = config.kda_num_heads, config.kda_head_dim
        width = config.kv_lora_rank + config.qk_rope_head_dim
        kw = dict(device=device)
        for i, kind in enumerate(cache.layer_types):
            if kind == "kda":
                state_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # KDA's compute dtype
                state = torch.empty(batch_size, h, dk, dk, dtype=state_dtype, **kw)
                cache.recurrent_states[i] = state.normal_(std=dk**-0.5, generator=generator)
                tail = torch.empty(batch_size, 3 * h * dk, config.short_conv_kernel_size - 1, dtype=dtype, **kw)
                cache.conv_tails[i] = tail.normal_(generator=generator)
            else:
                buf = torch.empty(batch_size, cache.max_length, width, dtype=dtype, **kw)
                buf[:, :num_tokens].normal_(generator=generator)
                cache._latents[i] = buf
        cache._seen_tokens = num_tokens
        return cache

    # --- transformers.Cache interface ----------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen_tokens + query_length, 0

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        """False for every layer: whatever the layer (KDA state or MLA latents), the cache has seen exactly
        `get_seq_length()` tokens, so `generate(full_ids, cache=returned_cache)` runs only the ids past them (as for
        transformers' attention caches; it would re-run the whole prompt on top of the cache for "linear" ones)."""
        return [False] * len(self.layer_types)

    @property
    def batch_size(self) -> int:
        for t in self._tensors():
            return t.shape[0]
        return -1

    def _tensors(self):
        for group in (self.recurrent_states, self.conv_tails, self._latents):
            yield from (t for t in group if t is not None)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for group in (self.recurrent_states, self.conv_tails, self._latents):
            for i, t in enumerate(group):
                if t is not None:
                    group[i] = fn(t)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        n = len(self.layer_types)
        self.recurrent_states, self.conv_tails, self._latents = [None] * n, [None] * n, [None] * n
        self._seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise KimiVLError(
                "KimiHybridCache cannot be cropped: KDA layers keep a recurrent state, not per-token entries."
            )

    def __len__(self) -> int:
        return len(self.layer_types)

    def __repr__(self) -> str:
        return f"KimiHybridCache(layers={self.layer_types}, seen_tokens={self._seen_tokens})"

    def nbytes(self) -> int:
        """Bytes actually held for the cached tokens (latent buffers counted up to the seen length)."""
        total = sum(t.numel() * t.element_size() for t in self.recurrent_states + self.conv_tails if t is not None)
        for buf in self._latents:
            if buf is not None:
                total += buf.shape[0] * self._seen_tokens * buf.shape[2] * buf.element_size()
        return total


class HybridCacheGenerationMixin:
    """For `GenerationMixin` models whose text backbone is Kimi's: `generate()` checks its prompt ids and gets a
    `KimiHybridCache` (built from `config.get_text_config()`, preallocated for the prompt and the new tokens) unless
    the caller passes a cache or turns caching off; a `cache_implementation` other than "dynamic" is ignored with a
    warning. A cache passed in with `num_beams` or `num_return_sequences` > 1 (continuing a conversation with several
    replies) is repeated for every copy of its rows, as the prompt ids are."""

    def generate(self, inputs: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' `generate`; prompt ids must be `[B, T]` with T >= 1, each in the vocabulary or a media
        placeholder id of the config (`ShapeError` otherwise, where torch would fail deep inside)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and kwargs.get("inputs_embeds") is None:
            if ids.dim() != 2 or ids.shape[1] == 0:
                raise ShapeError(f"prompt ids must be [B, T] with T >= 1, got shape {tuple(ids.shape)}; a single "
                                 "prompt is ids[None].")
            vocab = self.config.get_text_config().vocab_size
            media = [i for i in (getattr(self.config, "image_token_id", None),
                                 getattr(self.config, "video_token_id", None)) if i is not None]
            bad = (ids < 0) | ((ids >= vocab) & ~torch.isin(ids, torch.tensor(media, device=ids.device)))
            if bad.any():
                raise ShapeError(f"prompt id {int(ids[bad][0])} is outside the vocabulary (0..{vocab - 1}); encode the "
                                 "prompt with this model's tokenizer or processor.")
        config = kwargs.get("generation_config") or self.generation_config
        cache_implementation = kwargs.get("cache_implementation", config.cache_implementation)
        if cache_implementation not in (None, "dynamic"):
            warnings.warn(
                f"cache_implementation={cache_implementation!r} is ignored: Kimi models decode with a KimiHybridCache "
                "(fixed-size KDA states, MLA latents preallocated for prompt + new tokens), which has no static, "
                "offloaded or quantized variant; leave cache_implementation unset.", UserWarning, stacklevel=2,
            )
        return super().generate(inputs, *args, **kwargs)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ) -> None:
        cache = model_kwargs.get("cache")
        if cache is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = KimiHybridCache(self.config.get_text_config(), max_cache_length)
            return
        expand = max(generation_config.num_beams, generation_config.num_return_sequences)
        if isinstance(cache, KimiHybridCache) and expand > 1 and cache.batch_size == batch_size:
            # a cache continued with num_beams / num_return_sequences: one copy per copy of its row, as the inputs
            cache.batch_repeat_interleave(expand)
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
