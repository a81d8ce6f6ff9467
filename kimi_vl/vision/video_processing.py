"""`MoonViTVideoProcessor`: videos -> per-frame 14x14 patches grouped in temporal chunks for MoonViT-3D.

Frames: a video file (path or `file://` URL) is read with decord through `media.load_video`, sampling by
`num_frames` (uniform; wins over `fps`) or by `fps` (default 2 frames per second), at most `max_frames` frames;
`do_sample_frames=False` keeps every frame (still at most `max_frames`); variable-frame-rate files are sampled by
presentation time and their metadata (`TimedVideoMetadata`) carries the sample times. Decoded frames (a
`[T, H, W, 3]` / `[T, 3, H, W]` array or tensor, or a list of frames) are sampled the same way from `video_metadata`
(`total_num_frames`, `fps`) when `do_sample_frames` is on; sampling by fps then needs the metadata's `fps`. A video
given as a list of its frames' image files (transformers' convention: `[[[frame0.png, frame1.png, ...]]]`, as chat
templates pass `{"type": "video", "video": [frame paths]}`) is read with `media.load_image` and is decoded frames.

Each frame is resized and padded exactly like an image (`image_processing.fit_to_patch_budget`, default budget
4096 patches per frame), normalised and patchified. The frames of a video are split into chunks of
`temporal_patch_size` (4) consecutive frames (the last chunk may be shorter); the model mean-pools each chunk over
time after the 2x2 merge, so each chunk costs `grid_h * grid_w / merge**2` placeholder tokens.

Outputs (transformers' key names): `pixel_values_videos` `[sum_v T_v * h_v * w_v, 3, 14, 14]` (frames in order,
patches row-major in each frame), `video_grid_thw` `[total_chunks, 3]` rows `(frames_in_chunk, h, w)`,
`num_chunks_per_video` (one count per video), and `video_metadata` with `return_metadata=True`. The settings and
results are those of transformers' `Kimi_K25VideoProcessor` (the parity target).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import VideosKwargs
from transformers.utils import TensorType
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata, make_batched_videos

from ..errors import InvalidMediaError
from .image_processing import check_not_rescaled, check_square_size, patch_grid, patchify, resize_and_pad
from .media import DEFAULT_MAX_FRAMES, VideoFrames, load_image, load_video, sample_frame_indices


class MoonViTVideoProcessorKwargs(VideosKwargs, total=False):
    """Extra settings: `max_patches` (per frame), `patch_size`, `merge_size`, `temporal_patch_size` (frames per
    chunk), `max_frames` (upper bound on sampled frames)."""

    max_patches: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    max_frames: int


@dataclass
class TimedVideoMetadata(VideoMetadata):
    """transformers' `VideoMetadata` plus `frames_timestamps`: the time in seconds of each frame listed in
    `frames_indices` (the frames processed; `load_video`'s `timestamps`), for videos whose frames are not
    `frames_indices / fps` seconds in (variable-frame-rate files); None when they are. The chunk timestamps of the
    prompt (`kimi_vl.fusion.frame_times`) and `timestamps` use them when set."""

    frames_timestamps: list[float] | None = None

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each sampled frame: `frames_timestamps` when set, else `frames_indices / fps`."""
        return self.frames_timestamps if self.frames_timestamps is not None else super().timestamps


def clip_metadata(clip: VideoFrames) -> TimedVideoMetadata:
    """The metadata of frames read by `load_video`, to pass with them as `video_metadata` (with
    `do_sample_frames=False`): source frame count, rate, size, duration, sampled indices and, for a variable-rate
    file, the times its samples were taken at."""
    return TimedVideoMetadata(
        total_num_frames=clip.total_frames,
        fps=clip.fps,
        height=clip.frames.shape[1],
        width=clip.frames.shape[2],
        duration=clip.duration,
        video_backend="decord",
        frames_indices=clip.indices.tolist(),
        frames_timestamps=clip.timestamps.tolist() if clip.variable_rate else None,
    )


def fspath_videos(videos: Any) -> Any:
    """`os.PathLike` entries (nested lists allowed) as `str`, which transformers' video helpers understand."""
    if isinstance(videos, os.PathLike):
        return os.fspath(videos)
    if isinstance(videos, (list, tuple)):
        return [fspath_videos(v) for v in videos]
    return videos


def _has_file(videos: Any) -> bool:
    """Whether `videos` is, or (nested lists allowed) holds, a video file source (a path or a `file://` URL)."""
    if isinstance(videos, (list, tuple)):
        return any(_has_file(v) for v in videos)
    return isinstance(videos, (str, os.PathLike))


def _is_frame_list(video: Any) -> bool:
    """Whether `video` is one video given as a list of its frames' image files (paths, `file://` URLs or `data:`
    URIs), as transformers' chat templates pass `{"type": "video", "video": [frame, ...]}`."""
    return isinstance(video, (list, tuple)) and bool(video) and all(isinstance(f, (str, os.PathLike)) for f in video)


def read_frame_lists(videos: Any) -> Any:
    """`videos` (a batch: a list of per-text lists of videos) with each video given as a list of its frames' image
    files (transformers' nesting `[[[f0, f1, ...]]]`) read with `media.load_image` into a list of RGB PIL frames;
    everything else unchanged (`[[a, b]]` stays one text's two video files)."""
    if not isinstance(videos, (list, tuple)):
        return videos
    return [[[load_image(f) for f in v] if _is_frame_list(v) else v for v in text] if isinstance(text, (list, tuple))
            else text for text in videos]


def _join(values: list[Any]) -> Any:
    """One output key of several `preprocess` calls, concatenated along the first axis (tensors, arrays, lists)."""
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values)
    if isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    return [x for value in values for x in value]


def _check_frames(videos: Any) -> None:
    """Decoded videos as frame lists (one list of PIL images or `[H, W, C]` arrays, or a list of such lists) must
    each have at least one frame, all of one size: `InvalidMediaError` naming the video otherwise."""
    if not isinstance(videos, (list, tuple)):
        return
    whole = [v for v in videos if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) == 4]  # else one video's frames
    for i, frames in enumerate(whole if whole else [videos]):
        if len(frames) == 0:
            raise InvalidMediaError(f"video {i} has no frames; give each video at least one frame.")
        if getattr(frames, "ndim", 0) == 4:
            continue
        sizes = {f.size[::-1] if hasattr(f, "size") and not hasattr(f, "shape") else tuple(np.shape(f)[:2])
                 for f in frames}
        if len(sizes) > 1:
            raise InvalidMediaError(f"video {i} mixes frame sizes (height, width) {sorted(sizes)}; resize its frames "
                                    "to one size.")


class MoonViTVideoProcessor(BaseVideoProcessor):
    """Video processor of MoonViT-3D (same settings and outputs as `Kimi_K25VideoProcessor`, see module docstring)."""

    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    patch_size = 14
    temporal_patch_size = 4
    merge_size = 2
    max_patches = 4096
    fps = 2
    max_frames = DEFAULT_MAX_FRAMES
    do_sample_frames = True
    valid_kwargs = MoonViTVideoProcessorKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw", "num_chunks_per_video"]

    def preprocess(self, videos: Any, **kwargs: Any) -> BatchFeature:
        """Process one video or a list of videos (per-sample lists allowed): file paths / `file://` URLs, decoded
        frames, lists of frame image files, or a mix of them."""
        videos = read_frame_lists(fspath_videos(videos))
        if _has_file(videos):
            videos = make_batched_videos(videos)  # one flat list: [[a], [b, c]] -> [a, b, c]
            if not all(isinstance(v, str) for v in videos):
                return self._preprocess_each(videos, kwargs)
            videos, kwargs["video_metadata"] = self._read_files(videos, kwargs)
            kwargs["do_sample_frames"] = False  # sampled while decoding
        else:
            _check_frames(videos)
        return super().preprocess(videos, **kwargs)

    def _preprocess_each(self, videos: list[Any], kwargs: dict) -> BatchFeature:
        """Files mixed with decoded frames: each video processed alone (files read with decord, frames sampled from
        their own `video_metadata` entry), outputs concatenated in order."""
        metadata = kwargs.pop("video_metadata", None)
        outputs = []
        for i, video in enumerate(videos):
            own = metadata[i] if isinstance(metadata, (list, tuple)) else metadata
            extra = {} if own is None or isinstance(video, str) else {"video_metadata": [own]}
            outputs.append(self.preprocess([video], **kwargs, **extra))
        return BatchFeature(data={key: _join([out[key] for out in outputs]) for key in outputs[0]})

    def read_video(self, src: str, **kwargs: Any) -> VideoFrames:
        """One video file (a path or a `file://` URL) decoded and sampled with decord as `preprocess` reads it:
        `do_sample_frames`, `fps`, `num_frames` and `max_frames` from `kwargs`, else the processor's settings (other
        keys are ignored)."""
        setting = {k: kwargs.get(k, getattr(self, k)) for k in ("do_sample_frames", "fps", "num_frames", "max_frames")}
        sample = setting["do_sample_frames"]
        return load_video(
            src,
            fps=setting["fps"] if sample else None,
            num_frames=setting["num_frames"] if sample else None,
            max_frames=setting["max_frames"],
        )

    def _read_files(self, sources: list[str], kwargs: dict) -> tuple[list[np.ndarray], list[TimedVideoMetadata]]:
        """Decode and sample each file with decord (`read_video`); returns frames `[T, H, W, 3]` and metadata
        (`clip_metadata`) per video."""
        clips = [self.read_video(src, **kwargs) for src in sources]
        return [clip.frames for clip in clips], [clip_metadata(clip) for clip in clips]

    def sample_frames(
        self,
        metadata: VideoMetadata,
        num_frames: int | None = None,
        fps: float | None = None,
        max_frames: int | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """Indices of decoded frames to keep (`media.sample_frame_indices`; `num_frames` wins over `fps`)."""
        return sample_frame_indices(
            metadata.total_num_frames, source_fps=metadata.fps, fps=fps, num_frames=num_frames, max_frames=max_frames
        )

    def _validate_preprocess_kwargs(self, size: SizeDict | None = None, **kwargs: Any) -> None:
        check_square_size(size)
        super()._validate_preprocess_kwargs(size=size, **kwargs)

    def _preprocess(
        self,
        videos: list[torch.Tensor],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling | int | None,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: float | tuple[float, ...] | None,
        image_std: float | tuple[float, ...] | None,
        patch_size: int,
        temporal_patch_size: int,
        merge_size: int,
        max_patches: int,
        return_tensors: str | TensorType | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """`videos`: list of uint8 `[T, 3, H, W]` -> `pixel_values_videos`, `video_grid_thw`, `num_chunks_per_video`."""
        patches, grids, chunks = [], [], []
        for video in videos:
            check_not_rescaled(video, do_rescale, "video")
            video = resize_and_pad(self, video, do_resize, size, resample, patch_size, merge_size, max_patches)
            video = self.rescale_and_normalize(video, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            num_frames, grid_h, grid_w = video.shape[0], video.shape[-2] // patch_size, video.shape[-1] // patch_size
            patches.append(patchify(video, patch_size))
            starts = range(0, num_frames, temporal_patch_size)
            grids.extend([min(temporal_patch_size, num_frames - s), grid_h, grid_w] for s in starts)
            chunks.append(len(starts))
        return BatchFeature(
            data={
                "pixel_values_videos": torch.cat(patches),
                "video_grid_thw": torch.tensor(grids, dtype=torch.long),
                "num_chunks_per_video": chunks,
            },
            tensor_type=return_tensors,
        )

    def get_num_of_video_patches(
        self, num_frames: int, height: int, width: int, videos_kwargs: dict | None = None
    ) -> int:
        """Patches (before merging) of `num_frames` frames of `height x width`; `videos_kwargs` overrides settings."""
        grid_h, grid_w = patch_grid(self, height, width, videos_kwargs)
        return num_frames * grid_h * grid_w

    def get_num_video_tokens(self, num_frames: int, height: int, width: int, videos_kwargs: dict | None = None) -> int:
        """Placeholder tokens of a video: `ceil(num_frames / temporal_patch_size) * grid_h * grid_w / merge**2`."""
        overrides = videos_kwargs or {}
        merge = overrides.get("merge_size", self.merge_size)
        chunks = math.ceil(num_frames / overrides.get("temporal_patch_size", self.temporal_patch_size))
        per_frame = self.get_num_of_video_patches(num_frames, height, width, videos_kwargs) // num_frames
        return chunks * per_frame // merge**2


__all__ = [
    "MoonViTVideoProcessor", "MoonViTVideoProcessorKwargs", "TimedVideoMetadata", "clip_metadata", "fspath_videos",
    "read_frame_lists",
]
