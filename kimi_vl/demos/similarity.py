"""Visual similarity between a rendered web page and the frames of a screen recording.

Both images are first reduced (box filter) to `SMALL_WIDTH` = 64 px wide, the height keeping the aspect ratio of
the frame (`h' = round(64 * H / W)`). Terms, each in [0, 1], higher is more similar:

- `structure(a, b)`: SSIM (Wang et al. 2004) of the reduced images in grey (ITU-R BT.601 luma scaled to [0, 1]);
  7 x 7 uniform windows over the valid region, `C1 = 0.01**2`, `C2 = 0.03**2`; the mean SSIM is clipped to [0, 1].
- `colour_layout(a, b)`: the reduced images cut into an 8 x 8 grid of cells (row and column edges at
  `floor(i * size / 8)`), each cell replaced by its mean RGB colour;
  `1 - mean over cells of ||c_a - c_b||_2 / (255 * sqrt(3))` (1 for identical cell colours, 0 for black vs white).
  A frame wider than about 8.5 : 1 is reduced to under 8 rows: the mean is then over the cells that hold pixels.
- `image_similarity(a, b) = 0.5 * structure + 0.5 * colour_layout`.

A recording may be scrolled, so the page is compared through every window a frame could show:
`page_similarity(frames, page)` takes a page screenshot `page` as wide as the frames and at least as tall (e.g. a
render 8 screens tall), reduces it once to 64 px wide, and for each frame takes the best `image_similarity` over
all vertical windows of `h'` reduced rows (one window per reduced row, i.e. every `W / 64` px of the page); the
score is the mean of these per-frame bests. A page screenshot of the frames' size has a single window, and then
`page_similarity([a], b) == image_similarity(a, b)`.

Measured with headless Chromium (renders 8 screens tall, as `video2web` makes them) on six 160 x 120 synthetic
screencasts (8 frames scrolling down the page, mp4 round trip): the true page scores 0.967-0.983, another random
page of the same family 0.52-0.77, a blank white page 0.47-0.70.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import ConfigError

__all__ = ["PageScore", "colour_layout", "gap_closed", "image_similarity", "page_similarity", "ssim", "structure"]

SMALL_WIDTH = 64
GRID = 8
WINDOW = 7
_C1 = 0.01**2
_C2 = 0.03**2
_LUMA = np.array([0.299, 0.587, 0.114])

ImageLike = Image.Image | np.ndarray


def _to_image(x: ImageLike) -> Image.Image:
    if isinstance(x, Image.Image):
        return x.convert("RGB")
    array = np.asarray(x)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ConfigError(f"expected an RGB image or a uint8 [H, W, 3] array, got {array.dtype} {array.shape}.")
    return Image.fromarray(array)


def _small_height(width: int, height: int) -> int:
    return max(1, round(height * SMALL_WIDTH / width))


def _reduce(image: Image.Image, height: int) -> np.ndarray:
    """RGB `[height, SMALL_WIDTH, 3]` float in [0, 255] after a box-filter resize."""
    return np.asarray(image.resize((SMALL_WIDTH, height), Image.Resampling.BOX), dtype=np.float64)


def _box_mean(x: np.ndarray, k: int) -> np.ndarray:
    """Means over every k x k window (valid region) of the last two axes of `x [..., h, w]`."""
    c = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(1, 0), (1, 0)]).cumsum(-2).cumsum(-1)
    return (c[..., k:, k:] - c[..., :-k, k:] - c[..., k:, :-k] + c[..., :-k, :-k]) / (k * k)


def ssim(x: np.ndarray, y: np.ndarray, window: int = WINDOW) -> np.ndarray | float:
    """Mean SSIM of grey images in [0, 1]: `x [..., h, w]` against `y` of the same shape (or broadcastable:
    `y [h, w]` against a stack `x [N, h, w]` gives `[N]`), `window x window` uniform windows over the valid region
    (images smaller than the window use one window covering the whole image)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape[-2:] != y.shape[-2:]:
        raise ConfigError(f"ssim needs images of one shape, got {x.shape} and {y.shape}.")
    k = min(window, *x.shape[-2:])
    mx, my = _box_mean(x, k), _box_mean(y, k)
    vx = _box_mean(x * x, k) - mx * mx
    vy = _box_mean(y * y, k) - my * my
    cxy = _box_mean(x * y, k) - mx * my
    s = ((2 * mx * my + _C1) * (2 * cxy + _C2)) / ((mx * mx + my * my + _C1) * (vx + vy + _C2))
    out = s.mean(axis=(-2, -1))
    return float(out) if np.ndim(out) == 0 else out


def _cells(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Starts `[GRID]` and lengths `[GRID]` of the GRID cells along a side of `size` px (edges at
    `floor(i * size / GRID)`): a side under GRID px has empty cells, of length 0."""
    starts = np.floor(np.arange(GRID) * size / GRID).astype(int)
    return starts, np.diff(np.append(starts, size))


def _filled(h: int, w: int) -> np.ndarray:
    """`[GRID, GRID]` bool: the cells of an `h x w` image that hold pixels (all of them when both sides are at least
    GRID px)."""
    return (_cells(h)[1][:, None] * _cells(w)[1][None, :]) > 0


def _grid(rgb: np.ndarray) -> np.ndarray:
    """Mean colours `[..., GRID, GRID, 3]` of the GRID x GRID cells of `rgb [..., h, w, 3]` (meaningless in the
    empty cells of a side under GRID px: only the `_filled` cells are compared)."""
    (rows, heights), (cols, widths) = _cells(rgb.shape[-3]), _cells(rgb.shape[-2])
    sums = np.add.reduceat(np.add.reduceat(rgb, rows, axis=-3), cols, axis=-2)
    counts = heights[:, None] * widths[None, :]
    return sums / np.maximum(counts, 1)[..., None]


class _Windows:
    """Reduced page windows `[N, h, w, 3]` with what SSIM and the colour grid need of them, computed once."""

    def __init__(self, windows: np.ndarray) -> None:
        self.grey = (windows / 255.0) @ _LUMA  # [N, h, w]
        self.k = min(WINDOW, *self.grey.shape[-2:])
        self.mean = _box_mean(self.grey, self.k)
        self.var = _box_mean(self.grey * self.grey, self.k) - self.mean**2
        self.grid = _grid(windows)  # [N, GRID, GRID, 3]

    def terms(self, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Structure and colour-layout terms `[N]` of a reduced frame `[h, w, 3]` against every window."""
        y = (frame / 255.0) @ _LUMA
        my = _box_mean(y, self.k)
        vy = _box_mean(y * y, self.k) - my * my
        cxy = _box_mean(self.grey * y, self.k) - self.mean * my
        s = ((2 * self.mean * my + _C1) * (2 * cxy + _C2)) / ((self.mean**2 + my * my + _C1) * (self.var + vy + _C2))
        struct = np.clip(s.mean(axis=(-2, -1)), 0.0, 1.0)
        dist = np.sqrt(((self.grid - _grid(frame)) ** 2).sum(-1)) / (255.0 * np.sqrt(3.0))
        filled = _filled(*frame.shape[:2])  # mean over the filled cells only
        return struct, 1.0 - np.where(filled, dist, 0.0).mean(axis=(-2, -1)) * (filled.size / filled.sum())


def _terms(frame: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Structure and colour-layout terms `[N]` of a reduced frame `[h, w, 3]` against windows `[N, h, w, 3]`."""
    return _Windows(windows).terms(frame)


def _pair(a: ImageLike, b: ImageLike) -> tuple[np.ndarray, np.ndarray]:
    a, b = _to_image(a), _to_image(b)
    h = _small_height(*a.size)
    return _reduce(a, h), _reduce(b, h)


def structure(a: ImageLike, b: ImageLike) -> float:
    """SSIM term of the metric (module docstring), in [0, 1]; `b` is resized to `a`'s reduced size."""
    ra, rb = _pair(a, b)
    return float(_terms(ra, rb[None])[0][0])


def colour_layout(a: ImageLike, b: ImageLike) -> float:
    """Colour-layout term of the metric (module docstring), in [0, 1]; `b` is resized to `a`'s reduced size."""
    ra, rb = _pair(a, b)
    return float(_terms(ra, rb[None])[1][0])


def gap_closed(score: float, blank: float, true: float) -> float:
    """The share of the distance from a blank page's score to the true page's score that `score` covers (0: no
    better than blank, 1: as good as the true page)."""
    return (score - blank) / max(1e-9, true - blank)


def image_similarity(a: ImageLike, b: ImageLike) -> float:
    """`0.5 * structure(a, b) + 0.5 * colour_layout(a, b)` (module docstring), in [0, 1]."""
    ra, rb = _pair(a, b)
    st, co = _terms(ra, rb[None])
    return float(0.5 * st[0] + 0.5 * co[0])


@dataclass
class PageScore:
    """Result of `page_similarity`.

    Attributes:
        score: mean over frames of the best window similarity, in [0, 1].
        frame_scores: the best similarity of each frame.
        offsets: the page's vertical offset (px, at the page's resolution) of each frame's best window.
        structure: mean SSIM term at the best windows.
        colour_layout: mean colour-layout term at the best windows.
    """

    score: float
    frame_scores: list[float]
    offsets: list[int]
    structure: float
    colour_layout: float

    def to_dict(self) -> dict:
        return {
            "score": self.score,
            "structure": self.structure,
            "colour_layout": self.colour_layout,
            "frame_scores": self.frame_scores,
            "offsets": self.offsets,
            "metric": "mean over frames of the max over page windows of 0.5 * SSIM (grey, 64 px wide, 7x7 windows) "
                      "+ 0.5 * (1 - mean 8x8-cell RGB distance / (255*sqrt(3)))",
        }


def page_similarity(frames: Sequence[ImageLike], page: ImageLike) -> PageScore:
    """Similarity between the frames of a recording (each `W x H`) and a page screenshot `W x H_page`
    (`H_page >= H`, e.g. a render several screens tall) as defined in the module docstring.

    Raises:
        ConfigError: no frames, frames of different sizes, or a page of another width or shorter than the frames.
    """
    if len(frames) == 0:
        raise ConfigError("page_similarity needs at least one frame.")
    images = [_to_image(f) for f in frames]
    w, h = images[0].size
    if any(im.size != (w, h) for im in images):
        raise ConfigError(f"all frames must have one size; got {sorted({im.size for im in images})}.")
    page_img = _to_image(page)
    if page_img.width != w or page_img.height < h:
        raise ConfigError(
            f"the page screenshot is {page_img.width}x{page_img.height} but the frames are {w}x{h}; render the page "
            f"{w} px wide and at least {h} px tall."
        )
    small_h = _small_height(w, h)
    page_small = _reduce(page_img, max(small_h, _small_height(w, page_img.height)))
    n = page_small.shape[0] - small_h + 1
    windows = np.lib.stride_tricks.sliding_window_view(page_small, small_h, axis=0)  # [n, W', 3, h']
    windows = np.ascontiguousarray(windows.transpose(0, 3, 1, 2))  # [n, h', W', 3]
    scale = page_img.height / page_small.shape[0]
    prepared = _Windows(windows)
    best_scores, best_offsets, structs, colours = [], [], [], []
    for im in images:
        st, co = prepared.terms(_reduce(im, small_h))
        total = 0.5 * st + 0.5 * co
        i = int(np.argmax(total))
        best_scores.append(float(total[i]))
        best_offsets.append(round(i * scale) if n > 1 else 0)
        structs.append(float(st[i]))
        colours.append(float(co[i]))
    return PageScore(
        score=float(np.mean(best_scores)),
        frame_scores=best_scores,
        offsets=best_offsets,
        structure=float(np.mean(structs)),
        colour_layout=float(np.mean(colours)),
    )
