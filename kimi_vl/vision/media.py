"""Safe media I/O: images with Pillow, videos with decord (GIF animations, which decord cannot open, with Pillow).

Every failure (missing file, corrupt or truncated data, zero-size image, an image over the pixel limit, a video
without frames, a frame request the video cannot satisfy) raises `InvalidMediaError` naming the source and the
problem. Nothing is fetched from the network: only local paths, `file://` URLs and (for images) inline
`data:<mime>;base64,<payload>` URIs are read. Error messages shorten a long source to about 80 characters
(`short_source`).

Image mode rule (`to_rgb`), applied after the EXIF orientation:
- `RGB` is kept as is.
- Modes with an alpha band (`RGBA`, `LA`, `PA`, `RGBa`, `La`) and images carrying a `transparency` key (palette or
  colour-keyed `L`/`RGB`) go to `RGBA` and are alpha-composited over an opaque white background.
- Palette (`P`) images are expanded through `RGBA` and composited the same way (opaque palettes are unchanged by it).
- 16-bit greyscale (`I;16`, `I;16L`, `I;16B`, `I;16N`) and 32-bit integer (`I`, as Pillow decodes 16-bit PNG/TIFF)
  are clipped to [0, 65535] and scaled to 8 bits as `round(v * 255 / 65535)`, then replicated to three channels.
- Every other mode (`L`, `1`, `CMYK`, `YCbCr`, `LAB`, `HSV`, `F`, ...) uses Pillow's own `convert("RGB")`
  (`CMYK` is the naive, profile-free conversion; `F` is clipped to [0, 255]).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import decord
import numpy as np
from PIL import Image, ImageOps

from ..errors import ConfigError, InvalidMediaError, KimiVLError

DEFAULT_MAX_PIXELS = 89_478_485
"""Largest accepted width * height of an image: Pillow's `Image.MAX_IMAGE_PIXELS` (about 9459 x 9459)."""

DEFAULT_MAX_FRAMES = 512
"""Largest number of frames `load_video` returns by default."""

ImageSource = str | os.PathLike | bytes | Image.Image | np.ndarray
VideoSource = str | os.PathLike

_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_WIDE_GREY_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, Image.DecompressionBombError)


@dataclass
class VideoFrames:
    """Frames sampled from a video.

    Attributes:
        frames: uint8 RGB frames `[T, H, W, 3]`.
        timestamps: presentation time in seconds of each sampled frame `[T]` (float64); for a `variable_rate` source
            sampled by time, the time each sample was taken at (a frame shown across several is stamped with each).
        indices: index of each sampled frame in the decoded stream `[T]` (int64).
        fps: the source video's average frame rate (None when the container does not state a usable one).
        total_frames: number of frames in the source video.
        variable_rate: whether the source's frames do not follow a constant rate (a variable-frame-rate file, as
            screen recorders write: see `load_video`); its frames were then picked by presentation time and
            `timestamps`, not `indices / fps`, are their times.
        duration: seconds the source video lasts: `total_frames / fps` at a constant rate, the last frame's end minus
            the first frame's start at a variable one (None when unknown).
    """

    frames: np.ndarray
    timestamps: np.ndarray
    indices: np.ndarray
    fps: float | None
    total_frames: int
    variable_rate: bool = False
    duration: float | None = None


def short_source(text: str, limit: int = 80) -> str:
    """`text` (a media source: a path, a URL, a data URI) cut to about `limit` characters for an error message: a
    longer one keeps its start (a data URI's mime type) and its end (a path's file name) and says how long it is."""
    text = str(text)
    if len(text) <= limit:
        return text
    kept = max(limit - 24, 8)
    head = kept // 3
    return f"{text[:head]}...{text[head - kept:]} ({len(text):,} characters)"


def is_data_uri(src: Any) -> bool:
    """Whether `src` is an inline `data:` URI (a string starting with `data:`, case-insensitive)."""
    return isinstance(src, str) and src[:5].lower() == "data:"


def decode_data_uri(uri: str) -> tuple[str, bytes]:
    """`(mime type, payload bytes)` of `data:[<mime>][;base64],<payload>` (RFC 2397: base64, or percent-encoded
    without `;base64`; the mime type defaults to `text/plain`). `InvalidMediaError` when it is malformed."""
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise InvalidMediaError(f"data URI {short_source(uri)!r} has no ',' before its payload; write "
                                "data:<mime>;base64,<payload>.")
    params = [p.strip() for p in header.split(";")]
    mime = params[0].lower() or "text/plain"
    if any(p.lower() == "base64" for p in params[1:]):
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidMediaError(f"data URI {short_source(uri)!r} has an invalid base64 payload ({exc}); "
                                    "re-encode the file with base64.") from exc
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if not data:
        raise InvalidMediaError(f"data URI {short_source(uri)!r} has an empty payload; give the file's bytes.")
    return mime, data


def _local_path(src: str | os.PathLike, kind: str) -> Path:
    """A filesystem path from a path or a `file://` URL; other URL schemes are refused."""
    text = os.fspath(src)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    shown = short_source(text)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidMediaError(
                f"{kind} {shown!r}: file:// URLs must point to this machine (got host {parsed.netloc!r}); "
                "copy the file locally and pass its path."
            )
        path = Path(urllib.request.url2pathname(parsed.path))
    elif is_data_uri(text):
        raise InvalidMediaError(
            f"{kind} {shown!r}: inline data: URIs are read for images only; save the {kind} to a file and pass its "
            "path."
        )
    elif parsed.scheme and len(parsed.scheme) > 1:  # a one-letter scheme is a Windows drive letter
        raise InvalidMediaError(
            f"{kind} {shown!r}: only local paths, file:// URLs and data: URIs are read (no network access); "
            "download the file first and pass its path."
        )
    else:
        path = Path(text)
    try:
        is_file = path.is_file()
    except OSError as exc:  # e.g. ENAMETOOLONG: a long string that is no path (an inline base64 payload?)
        raise InvalidMediaError(
            f"{kind} {shown!r} is not a usable path ({exc.strerror}); pass the path of a local file, a file:// URL, "
            "or for an image its bytes or a data:<mime>;base64,<payload> URI."
        ) from exc
    if not is_file:
        problem = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise InvalidMediaError(f"{kind} file {short_source(str(path))!r} {problem}; check the path.")
    if path.stat().st_size == 0:
        raise InvalidMediaError(f"{kind} file {short_source(str(path))!r} is empty (0 bytes); re-export or "
                                "re-download it.")
    return path


def _check_pixels(name: str, width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise InvalidMediaError(f"image {name} has zero size ({width}x{height}); pass a non-empty image.")
    if width * height > max_pixels:
        raise InvalidMediaError(
            f"image {name} is {width}x{height} = {width * height:,} pixels, over the limit of {max_pixels:,} "
            "(refused before decoding); downscale it or pass a larger `max_pixels` if the file is trusted."
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert a decoded Pillow image of any mode to `RGB` by the module's mode rule (see the module docstring)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _ALPHA_MODES or mode == "P" or "transparency" in image.info:
        rgba = (image.convert("LA") if mode == "La" else image).convert("RGBA")  # Pillow has no La -> RGBA
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode in _WIDE_GREY_MODES:
        wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        grey = ((wide * 255 + 32767) // 65535).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    return image.convert("RGB")


def _array_to_image(array: np.ndarray) -> Image.Image:
    if array.dtype != np.uint8:
        raise InvalidMediaError(
            f"image array of dtype {array.dtype} is not supported; pass uint8 pixels (0..255), "
            "e.g. `array.astype(np.uint8)` after scaling."
        )
    shape = tuple(array.shape)
    if array.ndim == 3 and shape[2] not in (1, 3, 4) and shape[0] in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # channels first [C, H, W], as transformers' image processors accept
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        mode = "L"
    elif array.ndim == 3 and array.shape[2] in (3, 4):
        mode = "RGB" if array.shape[2] == 3 else "RGBA"
    else:
        raise InvalidMediaError(
            f"image array of shape {shape} is not an image; pass [H, W] greyscale, [H, W, C] or [C, H, W] with C in "
            "1, 3, 4."
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InvalidMediaError(f"image array of shape {shape} has zero size; pass a non-empty image.")
    return Image.fromarray(np.ascontiguousarray(array), mode=mode)


def load_image(src: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Read an image and return it as a decoded `RGB` Pillow image with its EXIF orientation applied.

    Args:
        src: a path (str or `os.PathLike`), a `file://` URL, an inline `data:image/...;base64,...` URI, the
            encoded file's bytes (PNG, JPEG, ...), a Pillow image, or a uint8 numpy array `[H, W]`, `[H, W, C]` or
            channels-first `[C, H, W]` with `C` 1, 3 or 4 (RGBA); an array whose last axis is 1, 3 or 4 is read as
            `[H, W, C]`.
        max_pixels: largest accepted width * height. Files are measured from their header, before any pixel data
            is decoded.

    Raises:
        InvalidMediaError: missing file, non-local URL, malformed data URI, unreadable / corrupt / truncated data,
            zero size, over `max_pixels`, or an array of unsupported shape or dtype.
    """
    if isinstance(src, np.ndarray):
        image = _array_to_image(src)
        name = f"<array {tuple(src.shape)}>"
    elif isinstance(src, Image.Image):
        image = src
        name = f"<PIL image {src.mode} {src.size}>"
    elif isinstance(src, (str, os.PathLike, bytes, bytearray)):
        if isinstance(src, (bytes, bytearray)):
            if not src:
                raise InvalidMediaError("image bytes are empty (0 bytes); pass the encoded image file's bytes.")
            path, name = io.BytesIO(bytes(src)), f"<{len(src)} bytes>"
        elif is_data_uri(src):
            mime, data = decode_data_uri(src)
            path, name = io.BytesIO(data), f"<data: URI, {mime}, {len(data)} bytes>"
        else:
            path = _local_path(src, "image")
            name = repr(short_source(str(path)))
        try:
            with warnings.catch_warnings():  # the pixel limit below replaces Pillow's bomb warning
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(path)  # lazy: reads the header only
        except Image.DecompressionBombError as exc:
            raise InvalidMediaError(
                f"image {name} is over Pillow's decompression-bomb limit ({exc}); downscale it first."
            ) from exc
        except _DECODE_ERRORS as exc:
            raise InvalidMediaError(
                f"image {name} cannot be read as an image ({type(exc).__name__}: {exc}); "
                "check that the file is a valid, complete image."
            ) from exc
    else:
        raise InvalidMediaError(
            f"cannot read an image from a {type(src).__name__}; pass a path, a file:// URL, encoded bytes, a PIL "
            "image, or a uint8 numpy array."
        )

    width, height = image.size
    _check_pixels(name, width, height, max_pixels)
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return to_rgb(image)
    except _DECODE_ERRORS as exc:
        raise InvalidMediaError(
            f"image {name} is corrupt or truncated ({type(exc).__name__}: {exc}); re-export or re-download it."
        ) from exc


def sample_frames(
    total_frames: int,
    *,
    source_fps: float | None,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int | None = None,
    frame_spans: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Indices `[n]` of the frames to keep, uniformly spaced: `floor(i * total_frames / n)` for `i < n`; and with
    `frame_spans`, the time in seconds `[n]` each sample stands for (else None).

    `n` is `num_frames` when given (it wins over `fps`); otherwise `max(1, int(duration * fps))` with
    `duration = total_frames / source_fps`, capped at `total_frames` (a target fps above the source fps keeps every
    frame once, nothing is duplicated); with neither, every frame is kept. If `n` then exceeds `max_frames`, `n`
    becomes `max_frames` (the effective rate is lower; the frames stay uniformly spaced over the whole video).

    With `frame_spans` (`[total_frames, 2]` start and end seconds of each frame, increasing starts, as decord's
    `get_frame_timestamp` gives; for variable-frame-rate videos) the frames are spaced uniformly in time instead:
    `duration` is the last frame's end minus the first frame's start (`source_fps` is not needed), sample `i` is
    taken at `start_0 + i * duration / n` and is the frame showing then (the last one starting at or before it), so
    a frame that stays on screen across several sample times is picked once for each, stamped with each of those
    times, as a constant-rate copy of the video would show it (keeping every frame, with neither `num_frames` nor
    `fps` and at most `max_frames` frames, still keeps each once, stamped with its own start). At a constant rate
    both rules pick the same frames.

    Raises:
        InvalidMediaError: `num_frames` exceeds `total_frames`, or `fps` sampling is asked without a `source_fps` nor
            `frame_spans`.
        ConfigError: `num_frames`, `fps` or `max_frames` not positive, or `num_frames > max_frames`.
    """
    if max_frames is not None and max_frames <= 0:
        raise ConfigError(f"max_frames must be positive, got {max_frames}.")
    if num_frames is not None:
        if num_frames <= 0:
            raise ConfigError(f"num_frames must be positive, got {num_frames}.")
        if max_frames is not None and num_frames > max_frames:
            raise ConfigError(
                f"num_frames={num_frames} exceeds max_frames={max_frames}; raise max_frames or ask fewer."
            )
        if num_frames > total_frames:
            raise InvalidMediaError(
                f"{num_frames} frames requested but the video has only {total_frames}; "
                f"ask for at most {total_frames} frames or sample by fps."
            )
        n = num_frames
    elif fps is not None:
        if not 0 < fps < math.inf:  # NaN fails too
            raise ConfigError(f"fps must be a positive, finite rate, got {fps}.")
        if not source_fps and frame_spans is None:
            raise InvalidMediaError(
                "sampling by fps needs the source frame rate, which is unknown for this video (decoded frames "
                "passed without one?); pass it as `video_metadata=[{'fps': ...}]`, sample by `num_frames`, or keep "
                "every frame with `do_sample_frames=False` (through `apply_chat_template`: "
                "`processor_kwargs={'do_sample_frames': False}`)."
            )
        duration = total_frames / source_fps if frame_spans is None else frame_spans[-1, 1] - frame_spans[0, 0]
        n = min(total_frames, max(1, int(duration * fps)))
    else:
        n = total_frames
    if max_frames is not None:
        n = min(n, max_frames)
    if frame_spans is None or (n == total_frames and num_frames is None and fps is None):  # by index, or every frame
        indices = np.arange(n, dtype=np.int64) * total_frames // n
        return indices, None if frame_spans is None else frame_spans[indices, 0]
    start, end = frame_spans[0, 0], frame_spans[-1, 1]
    times = start + np.arange(n) * (end - start) / n
    return (np.searchsorted(frame_spans[:, 0], times, side="right") - 1).astype(np.int64), times


def sample_frame_indices(total_frames: int, *, source_fps: float | None, fps: float | None = None,
                         num_frames: int | None = None, max_frames: int | None = None) -> np.ndarray:
    """The indices `[n]` `sample_frames` keeps of `total_frames` frames at a constant rate (decoded frames)."""
    return sample_frames(total_frames, source_fps=source_fps, fps=fps, num_frames=num_frames, max_frames=max_frames)[0]


def _variable_rate_spans(spans: np.ndarray, source_fps: float | None) -> np.ndarray | None:
    """`spans` (`[T, 2]` float64 start and end seconds of every frame) when the frames do not follow a constant rate
    (some frame starts more than half a frame period away from `first start + index / source_fps`, or the rate is
    unknown), for sampling by time (`sample_frames(frame_spans=...)`); None at a constant rate, and when the
    times are unusable (not finite, starts not increasing, last end not after its start): frames are then sampled
    by index and timed `index / fps`."""
    starts = spans[:, 0]
    if not (np.isfinite(spans).all() and (np.diff(starts) > 0).all() and spans[-1, 1] > starts[-1]):
        return None
    if source_fps is None:
        return spans
    drift = np.abs(starts - starts[0] - np.arange(len(starts)) / source_fps)
    return spans if drift.max() > 0.5 / source_fps else None


def _decode_frames(reader: Any, indices: list[int]) -> np.ndarray:
    """Frames `[T, H, W, 3]` uint8 at `indices`.

    decord 0.6 mis-sizes frames whose RGB row (3 * width bytes) is padded by FFmpeg (e.g. widths 16 and 48): its
    batch copy then fails and single frames come back as `[H, W, row_bytes / W]`. Those are read one by one and the
    first `3 * W` bytes of each row kept.
    """
    try:
        return reader.get_batch(indices).asnumpy()
    except decord.DECORDError:
        frames = []
        for i in indices:
            frame = reader[i].asnumpy()
            h, w = frame.shape[:2]
            frames.append(frame.reshape(h, -1)[:, : 3 * w].reshape(h, w, 3))
        return np.stack(frames)


GIF_DEFAULT_DELAY_MS = 100
"""Display time of a GIF frame whose delay is 10 ms or less (0 or 1 hundredth): browsers show it 100 ms."""


def _sample_video(name: str, total: int, source_fps: float | None, **sampling: Any
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """`sample_frames(total, source_fps=source_fps, **sampling)`, its `InvalidMediaError` naming the video."""
    try:
        return sample_frames(total, source_fps=source_fps, **sampling)
    except InvalidMediaError as exc:
        raise InvalidMediaError(f"video {name}: {exc}") from exc


def _is_gif(path: Path) -> bool:
    """Whether the file starts with a GIF signature (False when it cannot be read: decord then says why)."""
    try:
        with path.open("rb") as file:
            return file.read(6) in (b"GIF87a", b"GIF89a")
    except OSError:
        return False


def _load_gif(
    path: Path, name: str, *, fps: float | None, num_frames: int | None, max_frames: int
) -> VideoFrames:
    """`load_video` for a GIF animation, read with Pillow: each frame shows for its delay (`GIF_DEFAULT_DELAY_MS` when
    10 ms or less, as browsers play it), the frame rate is the average one (frames are sampled by time when the
    delays differ, see `load_video`) and frames are converted by `to_rgb` (transparent pixels on white)."""
    try:
        with Image.open(path) as image:
            delays = []
            for i in range(getattr(image, "n_frames", 1)):
                image.seek(i)
                delay = image.info.get("duration") or 0
                delays.append(delay if delay > 10 else GIF_DEFAULT_DELAY_MS)
            total, source_fps = len(delays), len(delays) * 1000.0 / sum(delays)
            starts = np.concatenate([[0.0], np.cumsum(delays[:-1], dtype=np.float64)]) / 1000.0
            spans = _variable_rate_spans(np.stack([starts, starts + np.asarray(delays) / 1000.0], 1), source_fps)
            indices, times = _sample_video(name, total, source_fps, fps=fps, num_frames=num_frames,
                                           max_frames=max_frames, frame_spans=spans)
            frames = []
            for i in indices.tolist():
                image.seek(i)
                frames.append(np.asarray(to_rgb(image.copy())))
    except _DECODE_ERRORS as exc:
        if isinstance(exc, KimiVLError):  # a sampling request the animation cannot satisfy
            raise
        raise InvalidMediaError(
            f"video {name} is a corrupt or truncated GIF ({type(exc).__name__}: {exc}); re-export it."
        ) from exc
    return VideoFrames(frames=np.stack(frames), timestamps=starts[indices] if times is None else times,
                       indices=indices, fps=source_fps, total_frames=total, variable_rate=spans is not None,
                       duration=sum(delays) / 1000.0 if spans is not None else total / source_fps)


def load_video(
    src: VideoSource,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int = DEFAULT_MAX_FRAMES,
) -> VideoFrames:
    """Decode a video with decord (CPU; a GIF animation with Pillow, see `_load_gif`) and sample frames uniformly by a
    target fps or by a frame count.

    Sampling rule (`sample_frames`): `num_frames` (wins over `fps`) picks that many uniformly spaced frames;
    `fps` picks `int(duration * fps)` (at least 1, at most as many as the video has frames); neither keeps every
    frame. When that would exceed `max_frames`, `max_frames` uniformly spaced frames are taken instead (the effective
    rate is then lower; the returned timestamps show it). Asking `num_frames` beyond the video's frame count is an
    error (`InvalidMediaError`), never padded, repeated or clamped.

    Variable frame rate (browser MediaRecorder webm, desktop screen recorders, GIFs with uneven delays): when some
    frame starts more than half a frame period away from where the average rate puts it, frames are spaced uniformly
    in presentation time (from each frame's start and end as decord reports them; the duration runs to the last
    frame's end) and each sample is the frame showing at its time, repeated when it stays on screen across several
    sample times (`variable_rate` is then True; `timestamps` are the sample times, as a constant-rate copy would
    have them). At a constant rate frames are spaced by index, as `floor(i * total_frames / n)`.

    Args:
        src: a path or a `file://` URL of a local video file.
        fps: target frames per second.
        num_frames: exact number of frames; must not exceed the video's frame count nor `max_frames`.
        max_frames: upper bound on returned frames.

    Returns:
        `VideoFrames` with frames `[T, H, W, 3]` uint8 and the source timestamps (seconds) of each frame.

    Raises:
        InvalidMediaError: missing file, undecodable / corrupt file, a video without frames, or more frames requested
            than exist.
        ConfigError: `max_frames`, `num_frames` or `fps` not positive, or `num_frames > max_frames`.
    """
    path = _local_path(src, "video")
    name = repr(short_source(str(path)))
    if _is_gif(path):
        return _load_gif(path, name, fps=fps, num_frames=num_frames, max_frames=max_frames)
    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        total = len(reader)
        source_fps: float | None = float(reader.get_avg_fps())
        spans = reader.get_frame_timestamp(list(range(total))).astype(np.float64) if total > 0 else None
    except (decord.DECORDError, RuntimeError, OSError, ValueError) as exc:
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if "video stream" in detail:  # decord's message for a container without (decodable) video frames
            raise InvalidMediaError(
                f"video {name} has no decodable video frames (no video track, an empty one, or a truncated file); "
                "pass a complete file with at least one video frame."
            ) from exc
        raise InvalidMediaError(
            f"video {name} cannot be decoded ({detail}); check that it is a complete video file FFmpeg can read."
        ) from exc
    if total <= 0:
        raise InvalidMediaError(f"video {name} contains no frames; pass a video with at least one frame.")
    if not (source_fps is not None and math.isfinite(source_fps) and source_fps > 0):
        source_fps = None
    variable = _variable_rate_spans(spans, source_fps)
    indices, times = _sample_video(name, total, source_fps, fps=fps, num_frames=num_frames, max_frames=max_frames,
                            frame_spans=variable)
    try:
        frames = _decode_frames(reader, indices.tolist())
    except (decord.DECORDError, RuntimeError, OSError, ValueError, IndexError) as exc:
        raise InvalidMediaError(
            f"video {name} is corrupt: some of its {total} frames cannot be decoded ({type(exc).__name__}); "
            "re-encode the file (e.g. with ffmpeg) and try again."
        ) from exc
    if variable is not None:
        duration: float | None = float(variable[-1, 1] - variable[0, 0])
    else:
        duration = total / source_fps if source_fps else None
    return VideoFrames(
        frames=np.ascontiguousarray(frames), timestamps=spans[indices, 0] if times is None else times,
        indices=indices, fps=source_fps,
        total_frames=total, variable_rate=variable is not None, duration=duration,
    )
