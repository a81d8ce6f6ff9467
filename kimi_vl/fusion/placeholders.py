"""Placeholder expansion: how many placeholder tokens stand for an image or a video, and the text around them.

One placeholder id per merged vision token, in the order of the vision features (`kimi_vl.fusion.embedding` writes
the features over them):
- an image of grid `(t, h, w)` becomes `<|media_pad|>` x `t * h * w // merge**2` (the chat template already wraps
  the single `<|media_pad|>` as `<|media_start|>image<|media_content|><|media_pad|><|media_end|>`);
- a video becomes, for every temporal chunk `c` (rows of `video_grid_thw`, `temporal_patch_size` frames each, the
  last one possibly shorter): `HH:MM:SS.mmm<|media_start|>video<|media_content|>` + `<|kimi_k25_video_placeholder|>`
  x `h_c * w_c // merge**2` + `<|media_end|>`, the timestamp being that of the chunk's first frame. This is the
  structure of transformers' `Kimi_K25Processor` (with Kimi-VL's `<|media_start|>` in place of its
  `<|media_begin|>`). Video tokens keep their own id, distinct from the image id, so the model scatters image and
  video features independently.
Timestamps are the metadata's `frames_timestamps` when it has them (`kimi_vl.vision.video_processing.
TimedVideoMetadata`: the sample times of a variable-frame-rate file, such as screen recorders
write), else `frame_index / fps`: exact for constant-rate video files (decoded with decord) and for decoded frames
passed with `video_metadata`. Decoded frames without metadata have no known times: the chunk timestamps then assume
consecutive frames at `ASSUMED_FPS` (24, transformers' fallback) and a warning says so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.utils import logging
from transformers.video_utils import VideoMetadata

from ..errors import InvalidMediaError
from ..tokenization.special_tokens import MEDIA_CONTENT, MEDIA_END, MEDIA_START

logger = logging.get_logger(__name__)

ASSUMED_FPS = 24.0
"""Frame rate assumed for chunk timestamps of decoded frames passed without `video_metadata`."""


def format_timestamp(seconds: float) -> str:
    """`HH:MM:SS.mmm` (milliseconds truncated), the chunk timestamp written before each video chunk."""
    seconds = max(0.0, float(seconds))
    millis = int(seconds * 1000)
    return time.strftime("%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}"


def image_placeholders(grid: Sequence[int] | torch.Tensor, token: str, merge: int) -> str:
    """`token` x `prod(grid) // merge**2`: the placeholders of one image of grid `(t, h, w)`."""
    return token * (int(torch.as_tensor(grid).prod()) // merge**2)


def video_placeholders(grids: torch.Tensor, times: Sequence[float], token: str, merge: int, chunk_len: int) -> str:
    """The timestamped media blocks of one video: `grids [chunks, 3]` (frames, h, w) per temporal chunk, `times`
    the seconds of each of its frames."""
    parts = []
    for c, (_, h, w) in enumerate(torch.as_tensor(grids).tolist()):
        pads = token * (h * w // merge**2)
        parts.append(f"{format_timestamp(times[c * chunk_len])}{MEDIA_START}video{MEDIA_CONTENT}{pads}{MEDIA_END}")
    return "".join(parts)


def frame_times(metadata: Any, video_idx: int, num_frames: int) -> list[float]:
    """Seconds of each processed frame of video `video_idx` (`frames_timestamps`, else `frame_index / fps`; see the
    module docstring).

    Raises:
        InvalidMediaError: the metadata's `frames_timestamps` does not hold one time per processed frame.
    """
    meta = None
    if isinstance(metadata, (list, tuple)) and video_idx < len(metadata):
        meta = metadata[video_idx]
    elif isinstance(metadata, (VideoMetadata, dict)) and video_idx == 0:
        meta = metadata
    times = getattr(meta, "frames_timestamps", None)
    if times is not None:
        if len(times) != num_frames:
            raise InvalidMediaError(
                f"video {video_idx}: its metadata's frames_timestamps holds {len(times)} times for {num_frames} "
                "processed frames; give the time of each frame kept, or pass the frames already sampled with "
                "do_sample_frames=False."
            )
        return [float(t) for t in times]
    fps = meta.get("fps") if meta is not None else None
    indices = meta.get("frames_indices") if meta is not None else None
    if indices is None or len(indices) != num_frames:
        indices = list(range(num_frames))
    if not fps:
        logger.warning_once(
            f"video {video_idx} has no frame rate in its metadata (decoded frames passed without "
            f"`video_metadata`?): its chunk timestamps assume {ASSUMED_FPS:g} fps. Pass `video_metadata` with "
            "`fps` (and `frames_indices`) for true timestamps."
        )
        fps = ASSUMED_FPS
    return [float(i) / float(fps) for i in np.asarray(indices).tolist()]


__all__ = ["ASSUMED_FPS", "format_timestamp", "frame_times", "image_placeholders", "video_placeholders"]
