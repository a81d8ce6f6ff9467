"""Synthetic UI screencasts for the video-to-website task: page spec -> frames -> video file -> target HTML.

A page (`PageSpec`) is deliberately simple so that a ~2M-parameter model can learn to write it: a dark header bar
with a white title, two light coloured sections (a bold heading and a few words each) and a button, all stacked
vertically (taller than a 160 x 120 viewport for most pages). `page_html` writes it as compact HTML (360-390
characters, ~140 tokens with the tiny preset's tokenizer; tags `html body div b button`; colours as CSS names;
explicit pixel sizes in inline styles). `render_frame` draws, with Pillow only, approximately what Chromium renders
for that HTML in a viewport of the same size: the same box layout to the pixel, text in Liberation Sans (what
Chromium uses for `sans-serif` on Debian; DejaVu Sans or Pillow's built-in font, with a warning, when it is not
installed: `screencast_font`), 13.33 px button labels as Chromium's buttons do not inherit the body font. Frames
can be scrolled and have one element hovered (darkened, with a mouse cursor on it). `make_screencast` turns a random
page into frames that show the top of the page, scroll down to the bottom, then hover the button; `write_video`
stores frames as an mp4 decord can read. On 160x120 viewports the mean absolute difference between `render_frame`
and Chromium's screenshot of `page_html` is about 2/255.

Layout (CSS pixels, viewport width `W`; the body has `margin:0`, so vertical margins of siblings collapse):
- header: `y = 0 .. header_height`, full width;
- section `i`: `x = 4 .. W - 4`, preceded by a 4 px gap, its own `height`;
- button: `x = 4 .. 4 + button_width`, height 20, preceded by an 8 px gap (an inline-block: its 4 px margin does not
  collapse with the section's); the document ends 4 px below it.

This module imports nothing from the rest of `kimi_vl.data`.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..errors import ConfigError

__all__ = [
    "COLORS",
    "Box",
    "PageSpec",
    "Screencast",
    "Section",
    "layout",
    "make_screencast",
    "page_height",
    "page_colors",
    "page_html",
    "random_page",
    "render_frame",
    "screencast_font",
    "write_video",
]

COLORS: dict[str, tuple[int, int, int]] = {
    # dark backgrounds (white text)
    "navy": (0, 0, 128), "teal": (0, 128, 128), "maroon": (128, 0, 0), "purple": (128, 0, 128),
    "green": (0, 128, 0), "olive": (128, 128, 0), "gray": (128, 128, 128), "black": (0, 0, 0),
    "blue": (0, 0, 255), "red": (255, 0, 0), "brown": (165, 42, 42), "indigo": (75, 0, 130),
    # light backgrounds (black text)
    "gold": (255, 215, 0), "pink": (255, 192, 203), "khaki": (240, 230, 140), "silver": (192, 192, 192),
    "orange": (255, 165, 0), "lime": (0, 255, 0), "aqua": (0, 255, 255), "tan": (210, 180, 140),
    "coral": (255, 127, 80), "plum": (221, 160, 221), "salmon": (250, 128, 114), "wheat": (245, 222, 179),
}
"""CSS named colours used by the pages, with their sRGB values (as Chromium paints them)."""

DARK_COLORS = frozenset(["navy", "teal", "maroon", "purple", "green", "olive", "gray", "black", "blue", "red",
                         "brown", "indigo"])
"""The dark colours of `COLORS` (white text on them): headers are dark, sections and buttons light."""
_TITLES = ("Shop", "Blog", "News", "Cafe", "Games", "Music", "Travel", "Studio", "Books", "Garden", "Sports",
           "Photos", "Bakery", "Hotel", "Radio", "Clinic")
_HEADINGS = ("Sale", "About", "Menu", "Team", "Prices", "Contact", "Events", "Hours", "Tips", "Offers", "Jobs",
             "Help", "Map", "Deals", "Home", "Story")
_WORDS = ("fresh", "daily", "new", "big", "deals", "coffee", "news", "open", "late", "best", "local", "free", "fast",
          "food", "art", "today", "cheap", "fun", "hot", "cold")
_BUTTONS = ("Buy", "Go", "Join", "Send", "More", "Book", "Start", "Order", "Login", "Call")

SECTIONS = 2
GAP = 4
"""Vertical gap (collapsed margins) before each section and the button, and the sections' side margins."""
BUTTON_HEIGHT = 20
FONT_SIZE = 10
BUTTON_FONT_SIZE = 13.333  # Chromium's buttons do not inherit the body font: 13.333px
_BASELINE = 8  # text baseline below a box's top for a 10 px Liberation Sans line (measured against Chromium)
_BUTTON_BASELINE = 15  # baseline of the button's label, vertically centred in its 20 px (measured)


@dataclass(frozen=True)
class Section:
    """One coloured block: a bold `heading` followed by `text`, on background `color`, `height` CSS px tall
    (28..64)."""

    heading: str
    text: str
    color: str
    height: int


@dataclass(frozen=True)
class PageSpec:
    """The description a page is generated from (see the module docstring for its layout)."""

    title: str
    header_color: str
    header_height: int
    sections: tuple[Section, ...]
    button: str
    button_color: str
    button_width: int


@dataclass(frozen=True)
class Box:
    """A laid-out element in document coordinates: `x0 <= x < x1`, `y0 <= y < y1` (CSS px)."""

    kind: str  # "header" | "section" | "button"
    x0: int
    y0: int
    x1: int
    y1: int
    color: str


@dataclass
class Screencast:
    """A screen recording of one page.

    Attributes:
        frames: RGB Pillow images, all `width x height`.
        fps: frame rate of the recording.
        html: the page's HTML (`page_html(spec)`): the target of video-to-website.
        spec: the page description.
        scrolls: vertical scroll offset (CSS px) of each frame.
        hovers: index of the hovered element in `layout(spec, width)` for each frame, or None.
    """

    frames: list[Image.Image]
    fps: float
    html: str
    spec: PageSpec
    scrolls: list[int] = field(default_factory=list)
    hovers: list[int | None] = field(default_factory=list)


def _text_color(color: str) -> str:
    return "#fff" if color in DARK_COLORS else "#000"


def random_page(rng: random.Random) -> PageSpec:
    """A random page: a dark header (white title), two light sections and a light button (black text), all
    background colours distinct. Deterministic given the `rng` state.

    Two sections keep a whole training document within the tiny preset's 256-token rows: with its tokenizer the
    HTML is ~140 tokens and a pre-training document (8 frames at 160 x 120 + question + HTML) at most ~235 tokens;
    a third section would add ~35 tokens."""
    n = SECTIONS
    light = rng.sample(sorted(set(COLORS) - DARK_COLORS), n + 1)
    headings = rng.sample(_HEADINGS, n)
    sections = tuple(
        Section(
            heading=headings[i],
            text=" ".join(rng.sample(_WORDS, rng.randint(1, 2))),
            color=light[i],
            height=rng.randrange(28, 68, 4),
        )
        for i in range(n)
    )
    return PageSpec(
        title=rng.choice(_TITLES),
        header_color=rng.choice(sorted(DARK_COLORS)),
        header_height=rng.randrange(16, 32, 4),
        sections=sections,
        button=rng.choice(_BUTTONS),
        button_color=light[-1],
        button_width=rng.randrange(40, 80, 8),
    )


def page_colors(spec: PageSpec) -> list[str]:
    """The page's background colours in document order: header, sections, button."""
    return [spec.header_color, *(s.color for s in spec.sections), spec.button_color]


def _style(*parts: str) -> str:
    return ";".join(parts)


def page_html(spec: PageSpec) -> str:
    """The page as compact HTML (one line, 360-390 characters), e.g.

    `<html><body style="margin:0;font:10px sans-serif"><div style="height:20px;background:navy;color:#fff">Shop</div>
    <div style="margin:4px;height:36px;background:gold"><b>Sale</b> big deals</div>...
    <button style="margin:4px;width:56px;height:20px;border:0;background:pink">Buy</button></body></html>`
    (without the line breaks). Text colour is given only where it is white (on dark colours).
    """

    def colored(color: str) -> list[str]:
        return [f"background:{color}"] + (["color:#fff"] if color in DARK_COLORS else [])

    out = ['<html><body style="margin:0;font:10px sans-serif">']
    out.append(f'<div style="{_style(f"height:{spec.header_height}px", *colored(spec.header_color))}">'
               f"{spec.title}</div>")
    for s in spec.sections:
        out.append(f'<div style="{_style(f"margin:{GAP}px", f"height:{s.height}px", *colored(s.color))}">'
                   f"<b>{s.heading}</b> {s.text}</div>")
    style = _style(f"margin:{GAP}px", f"width:{spec.button_width}px", f"height:{BUTTON_HEIGHT}px", "border:0",
                   *colored(spec.button_color))
    out.append(f'<button style="{style}">{spec.button}</button></body></html>')
    return "".join(out)


def layout(spec: PageSpec, width: int) -> list[Box]:
    """Element boxes in document coordinates for a viewport `width` px wide: header, sections..., button."""
    boxes = [Box("header", 0, 0, width, spec.header_height, spec.header_color)]
    y = spec.header_height
    for s in spec.sections:
        y += GAP
        boxes.append(Box("section", GAP, y, width - GAP, y + s.height, s.color))
        y += s.height
    # the button is an inline-block on its own line: its margins do not collapse with the section's
    y += 2 * GAP
    boxes.append(Box("button", GAP, y, GAP + spec.button_width, y + BUTTON_HEIGHT, spec.button_color))
    return boxes


def page_height(spec: PageSpec, width: int = 160) -> int:
    """Document height in CSS px (the button's line ends 4 px below the button)."""
    return layout(spec, width)[-1].y1 + GAP


_FONT_DIRS = ("/usr/share/fonts/truetype/liberation", "/usr/share/fonts/liberation", "/usr/share/fonts/TTF",
              "/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu")
_FONT_FILES = {"Liberation Sans": ("LiberationSans-Regular.ttf", "LiberationSans-Bold.ttf"),
               "DejaVu Sans": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf")}
BUILTIN_FONT = "Pillow's built-in font"


@lru_cache(maxsize=1)
def _font_files() -> tuple[str, Path | None, Path | None]:
    """`(family, regular file, bold file)`: Liberation Sans (what Chromium uses for `sans-serif` on Debian: Arial's
    metric twin), else DejaVu Sans, else Pillow's built-in font (no files). Warns once when it is not Liberation
    Sans: the frames, and with them the embedded pre-training data, then differ from a machine that has it."""
    family, regular, bold = BUILTIN_FONT, None, None
    for name, files in _FONT_FILES.items():
        paths = [next((Path(d) / f for d in _FONT_DIRS if (Path(d) / f).is_file()), None) for f in files]
        if all(paths):
            family, (regular, bold) = name, paths
            break
    if family != "Liberation Sans":
        warnings.warn(f"Liberation Sans is not installed: screencast frames are drawn in {family}, so they (and the "
                      "embedded pre-training data, the demo and the figures in README) differ from those of a machine "
                      "that has it. Install it (Debian/Ubuntu: apt-get install fonts-liberation) for the published "
                      "data.", stacklevel=2)
    return family, regular, bold


def screencast_font() -> str:
    """The font family screencast frames are drawn in on this machine (recorded in the embedded data's fingerprint)."""
    return _font_files()[0]


@lru_cache(maxsize=8)
def _font(bold: bool, size: float = FONT_SIZE) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    path = _font_files()[2 if bold else 1]
    return ImageFont.load_default(size) if path is None else ImageFont.truetype(str(path), size)


def _shade(rgb: tuple[int, int, int], factor: float = 0.8) -> tuple[int, int, int]:
    return (int(rgb[0] * factor), int(rgb[1] * factor), int(rgb[2] * factor))


def _cursor(draw: ImageDraw.ImageDraw, x: int, y: int) -> None:
    """A 7 x 10 px arrow pointer with its tip at (x, y)."""
    pts = [(x, y), (x, y + 10), (x + 3, y + 7), (x + 7, y + 7)]
    draw.polygon(pts, fill=(0, 0, 0), outline=(255, 255, 255))


def render_frame(
    spec: PageSpec, width: int, height: int, *, scroll: int = 0, hover: int | None = None
) -> Image.Image:
    """Draw the page in a `width x height` viewport scrolled down by `scroll` px, approximating Chromium.

    Args:
        spec: the page.
        width, height: viewport size in px.
        scroll: vertical scroll offset (clamped to `0 .. page_height - height`).
        hover: index into `layout(spec, width)` of an element drawn hovered (background darkened by 20% and a mouse
            cursor at its centre), or None.

    Returns:
        an RGB image `width x height`.
    """
    if width <= 0 or height <= 0:
        raise ConfigError(f"viewport must be positive, got {width}x{height}.")
    boxes = layout(spec, width)
    if hover is not None and not 0 <= hover < len(boxes):
        raise ConfigError(f"hover index {hover} is outside the page's {len(boxes)} elements (0..{len(boxes) - 1}).")
    scroll = max(0, min(int(scroll), page_height(spec, width) - height))
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    regular, bold = _font(False), _font(True)
    texts = [spec.title] + [s.heading for s in spec.sections] + [spec.button]
    for i, box in enumerate(boxes):
        y0, y1 = box.y0 - scroll, box.y1 - scroll
        if y1 <= 0 or y0 >= height:
            continue
        rgb = COLORS[box.color]
        if hover == i:
            rgb = _shade(rgb)
        draw.rectangle([box.x0, y0, box.x1 - 1, y1 - 1], fill=rgb)
        ink = (255, 255, 255) if box.color in DARK_COLORS else (0, 0, 0)
        if box.kind == "button":
            font = _font(False, BUTTON_FONT_SIZE)
            tw = draw.textlength(texts[i], font=font)
            draw.text((box.x0 + (box.x1 - box.x0 - tw) / 2, y0 + _BUTTON_BASELINE), texts[i], fill=ink, font=font,
                      anchor="ls")
        elif box.kind == "header":
            draw.text((box.x0, y0 + _BASELINE), texts[i], fill=ink, font=regular, anchor="ls")
        else:
            section = spec.sections[i - 1]
            draw.text((box.x0, y0 + _BASELINE), section.heading, fill=ink, font=bold, anchor="ls")
            x = box.x0 + draw.textlength(section.heading + " ", font=bold)
            draw.text((x, y0 + _BASELINE), section.text, fill=ink, font=regular, anchor="ls")
    if hover is not None:
        box = boxes[hover]
        cx = (box.x0 + box.x1) // 2
        cy = min(max((box.y0 + box.y1) // 2 - scroll, 0), height - 1)
        _cursor(draw, cx, cy)
    return image


def make_screencast(
    rng: random.Random, *, width: int = 160, height: int = 120, num_frames: int = 8, fps: float = 4.0
) -> Screencast:
    """A random page recorded as `num_frames` frames: the top of the page (first quarter), a scroll to the bottom
    (middle), then the button hovered at the bottom (last quarter). Short pages that do not scroll hover the
    sections one after another instead. Deterministic given the `rng` state."""
    if num_frames <= 0:
        raise ConfigError(f"num_frames must be positive, got {num_frames}.")
    if fps <= 0:
        raise ConfigError(f"fps must be positive, got {fps}.")
    spec = random_page(rng)
    boxes = layout(spec, width)
    max_scroll = max(0, page_height(spec, width) - height)
    head = max(1, num_frames // 4)
    tail = max(1, num_frames // 4) if num_frames >= 3 else 0
    middle = num_frames - head - tail
    scrolls: list[int] = []
    hovers: list[int | None] = []
    for i in range(num_frames):
        if i < head:
            scrolls.append(0)
            hovers.append(None)
        elif i < head + middle:
            t = (i - head + 1) / middle
            scrolls.append(round(max_scroll * t))
            hovers.append(None if max_scroll else 1 + (i - head) % len(spec.sections))
        else:
            scrolls.append(max_scroll)
            hovers.append(len(boxes) - 1)
    drawn: dict[tuple[int, int | None], Image.Image] = {}  # the first and last quarters each repeat one view
    for view in zip(scrolls, hovers):
        if view not in drawn:
            drawn[view] = render_frame(spec, width, height, scroll=view[0], hover=view[1])
    frames = [drawn[view].copy() for view in zip(scrolls, hovers)]
    return Screencast(frames=frames, fps=float(fps), html=page_html(spec), spec=spec, scrolls=scrolls, hovers=hovers)


def write_video(frames: Sequence[Image.Image | np.ndarray], path: str | Path, fps: float) -> Path:
    """Encode frames (RGB Pillow images or uint8 `[H, W, 3]` arrays, all one size) as an mp4 that decord reads.

    H.264 (libx264, CRF 12, yuv420p) when PyAV has it, else MPEG-4 part 2 at a high bitrate. Width and height must be
    even (yuv420p). Returns the path written.
    """
    import av  # local: only needed when writing files

    if not frames:
        raise ConfigError("write_video needs at least one frame.")
    if fps <= 0:
        raise ConfigError(f"fps must be positive, got {fps}.")
    arrays = [np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f, dtype=np.uint8) for f in frames]
    h, w = arrays[0].shape[:2]
    if any(a.shape != (h, w, 3) for a in arrays):
        raise ConfigError(f"all frames must be RGB and {w}x{h}; got shapes {sorted({a.shape for a in arrays})}.")
    if h % 2 or w % 2:
        raise ConfigError(f"mp4 (yuv420p) needs even width and height, got {w}x{h}; crop or pad the frames by 1 px.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(1001)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "12", "preset": "fast"}
        else:
            stream.bit_rate = max(200_000, w * h * 24)
        for a in arrays:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        container.mux(stream.encode())
    return path
