"""Early fusion in the model: media -> projected tokens, written over their placeholders in the shared sequence.

Images and video chunks are encoded by MoonViT-3D (one packed pass), merged 2x2 (video chunks also averaged over up
to 4 frames) and projected to the text width (`media_tokens`); `fuse_media` embeds the token ids and writes each
kind's media tokens over the embeddings of its placeholder id (`image_token_id` / `video_token_id`), in order
(`scatter_media`). Placeholder ids are never looked up in the embedding table: they may lie outside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..errors import InvalidMediaError, ShapeError


def media_tokens(vision_tower: nn.Module, projector: nn.Module, pixel_values: torch.Tensor,
                 grid_thw: torch.Tensor) -> torch.Tensor:
    """`[num_merged, text_hidden]` tokens of images or video chunks: `pixel_values [patches, 3, 14, 14]` with
    `grid_thw [n, 3]` through the vision tower (merged tokens `[num_merged, kh * kw, vision_hidden]`) and the
    projector."""
    vision_dtype = next(vision_tower.parameters()).dtype
    merged = vision_tower(pixel_values.to(vision_dtype), grid_thw).pooler_output
    return projector(merged)


def scatter_media(
    embeds: torch.Tensor, input_ids: torch.Tensor, token_id: int, features: torch.Tensor, kind: str
) -> torch.Tensor:
    """Write `features [N, hidden]` over the embeddings `[B, T, hidden]` at the N positions where
    `input_ids == token_id` (row-major order); raise `InvalidMediaError` naming both counts on a mismatch."""
    mask = input_ids == token_id
    n = int(mask.sum())
    if n != features.shape[0]:
        raise InvalidMediaError(
            f"the text has {n} {kind} placeholder tokens but the {kind}s give {features.shape[0]} {kind} tokens; "
            f"build inputs with KimiVLProcessor, which expands one placeholder per {kind} into the right count, with "
            "processor settings that match the model's vision config (the processors' `merge_size` its "
            "`merge_kernel_size`, the video processor's `temporal_patch_size` its `temporal_chunk_size`)."
        )
    return embeds.masked_scatter(mask[..., None], features.to(embeds.dtype))


def fuse_media(
    embed_tokens: nn.Embedding,
    input_ids: torch.Tensor,
    media: Sequence[tuple[int, torch.Tensor | None, torch.Tensor | None]],
    features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Embeddings `[B, T, hidden]` of `input_ids [B, T]` with every kind of media written over its placeholders:
    `media` holds `(placeholder id, pixels or None, grid or None)` per kind (image, video), `features(pixels, grid)`
    gives their tokens (`media_tokens`)."""
    placeholders = torch.zeros_like(input_ids, dtype=torch.bool)
    for token_id, _, _ in media:
        placeholders |= input_ids == token_id
    embeds = embed_tokens(input_ids.masked_fill(placeholders, 0))
    for (token_id, pixels, grid), kind in zip(media, ("image", "video")):
        if pixels is None:
            tokens = embeds.new_zeros(0, embeds.shape[-1])
        elif grid is None:
            raise ShapeError(f"{kind} pixels were given without their grid ({kind}_grid_thw).")
        else:
            tokens = features(pixels, grid)
        embeds = scatter_media(embeds, input_ids, token_id, tokens, kind)
    return embeds


def repeat_media_per_sample(
    placeholders: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor, tokens_per_row: torch.Tensor,
    repeats: int, kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The media of a batch repeated as `input_ids.repeat_interleave(repeats, 0)` repeats its samples (generation's
    `num_return_sequences` and beams): each sample's own media, whole and in order, `repeats` times in a row.

    `placeholders [B, T]` marks the placeholder tokens of this kind, `pixel_values [patches, ...]` with
    `grid_thw [n, 3]` are the media of the whole batch, `tokens_per_row [n]` the placeholder tokens of each grid
    row. Returns `(pixel_values, grid_thw)` for the `B * repeats` samples. Raises `InvalidMediaError` when the
    placeholders and the media do not match (counts, or a medium split between two samples)."""
    row_ends = tokens_per_row.to(placeholders.device).cumsum(0)
    sample_ends = placeholders.sum(1).cumsum(0)
    total = int(row_ends[-1]) if len(row_ends) else 0
    if int(sample_ends[-1]) != total or not bool(torch.isin(sample_ends[sample_ends > 0], row_ends).all()):
        raise InvalidMediaError(
            f"the text has {int(sample_ends[-1])} {kind} placeholder tokens but the {kind}s give {total} {kind} "
            f"tokens, or a {kind}'s tokens span two samples; build inputs with KimiVLProcessor."
        )
    rows = [0, *torch.searchsorted(row_ends, sample_ends, right=True).tolist()]
    patches = [0, *grid_thw.prod(-1).cumsum(0).tolist()]
    pixels, grids = [], []
    for start, end in zip(rows[:-1], rows[1:]):
        pixels += [pixel_values[patches[start] : patches[end]]] * repeats
        grids += [grid_thw[start:end]] * repeats
    return torch.cat(pixels), torch.cat(grids)


__all__ = ["fuse_media", "media_tokens", "repeat_media_per_sample", "scatter_media"]
