"""Synthetic UI screencasts (kimi_vl.data.screencast): pages, Pillow frames, mp4 round trip."""

import random
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from kimi_vl.data.screencast import (
    COLORS,
    Screencast,
    layout,
    make_screencast,
    page_height,
    page_html,
    random_page,
    render_frame,
    write_video,
)
from kimi_vl.errors import ConfigError
from kimi_vl.vision.media import load_video


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.seen: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        self.seen.add(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack)
        self.stack.pop()


def test_page_html_is_short_balanced_and_deterministic():
    lengths = []
    for seed in range(100):
        spec = random_page(random.Random(seed))
        assert spec == random_page(random.Random(seed))
        html = page_html(spec)
        lengths.append(len(html))
        parser = _Tags()
        parser.feed(html)
        parser.close()
        assert parser.stack == [] and parser.seen <= {"html", "body", "div", "b", "button"}
        assert html.startswith("<html>") and html.endswith("</html>")
        assert spec.title in html and all(s.heading in html for s in spec.sections) and spec.button in html
        assert all(c in COLORS for c in [spec.header_color, spec.button_color] + [s.color for s in spec.sections])
    assert max(lengths) < 400


def test_render_frame_layout_scroll_and_hover():
    spec = random_page(random.Random(5))
    w, h = 160, 120
    boxes = layout(spec, w)
    assert [b.kind for b in boxes] == ["header"] + ["section"] * len(spec.sections) + ["button"]
    img = np.asarray(render_frame(spec, w, h))
    assert img.shape == (h, w, 3)
    # box colours away from text: the right end of the header and of each visible section
    assert tuple(img[spec.header_height - 2, w - 3]) == COLORS[spec.header_color]
    for box in boxes[1:-1]:
        if box.y1 <= h:
            assert tuple(img[box.y1 - 2, w - 6]) == COLORS[box.color]
            assert tuple(img[box.y1 - 2, 1]) == (255, 255, 255)  # the 4 px side margin
    # scrolling to the bottom shows the button; scroll is clamped to the page
    bottom = page_height(spec, w) - h
    assert bottom > 0
    scrolled = np.asarray(render_frame(spec, w, h, scroll=10_000))
    button = boxes[-1]
    assert tuple(scrolled[button.y1 - bottom - 2, button.x0 + 1]) == COLORS[button.color]
    assert np.array_equal(scrolled, np.asarray(render_frame(spec, w, h, scroll=bottom)))
    # hovering darkens the element and draws a cursor
    hovered = np.asarray(render_frame(spec, w, h, hover=1))
    y = boxes[1].y1 - 2
    assert (hovered[y, w - 6].astype(int) < img[y, w - 6].astype(int)).any()
    with pytest.raises(ConfigError):
        render_frame(spec, w, h, hover=len(boxes))


def test_make_screencast_scrolls_then_hovers():
    sc = make_screencast(random.Random(3), width=96, height=64, num_frames=8, fps=4.0)
    assert isinstance(sc, Screencast) and len(sc.frames) == 8 and sc.fps == 4.0
    assert all(f.size == (96, 64) and f.mode == "RGB" for f in sc.frames)
    assert sc.html == page_html(sc.spec)
    assert sc.scrolls[0] == 0 and sc.scrolls == sorted(sc.scrolls) and sc.scrolls[-1] > 0
    assert sc.hovers[0] is None and sc.hovers[-1] == len(layout(sc.spec, 96)) - 1
    for frame, scroll, hover in zip(sc.frames, sc.scrolls, sc.hovers):  # repeated views are drawn once, copied
        drawn = render_frame(sc.spec, 96, 64, scroll=scroll, hover=hover)
        assert np.array_equal(np.asarray(frame), np.asarray(drawn))
    sc.frames[0].paste((1, 2, 3), (0, 0, 96, 64))
    assert sc.frames[1].getpixel((0, 0)) != (1, 2, 3)  # each frame its own image
    again = make_screencast(random.Random(3), width=96, height=64, num_frames=8, fps=4.0)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(sc.frames[1:], again.frames[1:]))
    one = make_screencast(random.Random(0), num_frames=1)
    assert len(one.frames) == 1 and one.scrolls == [0]


def test_write_video_round_trip(tmp_path):
    sc = make_screencast(random.Random(7), width=160, height=120, num_frames=6, fps=3.0)
    path = write_video(sc.frames, tmp_path / "sub" / "cast.mp4", sc.fps)
    video = load_video(path)
    assert video.frames.shape == (6, 120, 160, 3) and video.fps == pytest.approx(3.0)
    original = np.stack([np.asarray(f) for f in sc.frames]).astype(np.float32)
    assert np.abs(original - video.frames).mean() < 6.0
    with pytest.raises(ConfigError, match="even"):
        write_video([np.zeros((11, 16, 3), np.uint8)], tmp_path / "odd.mp4", 4.0)
    with pytest.raises(ConfigError):
        write_video([], tmp_path / "none.mp4", 4.0)


@pytest.fixture
def fonts(monkeypatch):
    """`use(folders)`: the font folders `screencast` searches, its caches cleared (and cleared again afterwards)."""
    from kimi_vl.data import screencast

    def clear():
        screencast._font_files.cache_clear()
        screencast._font.cache_clear()

    def use(folders):
        monkeypatch.setattr(screencast, "_FONT_DIRS", tuple(map(str, folders)))
        clear()

    yield use
    clear()


def test_frames_fall_back_to_another_font_with_a_warning(fonts):
    """Without Liberation Sans the frames are drawn in DejaVu Sans, else Pillow's font, and the change is announced
    (the embedded pre-training data depends on it); the data fingerprint records the family, so a resume notices."""
    import matplotlib

    from kimi_vl.data.config import data_fingerprint
    from kimi_vl.data.mixture import fingerprint_changes
    from kimi_vl.data.screencast import BUILTIN_FONT, screencast_font

    spec = random_page(random.Random(3))
    here = screencast_font()
    drawn = np.asarray(render_frame(spec, 160, 120))
    recorded = data_fingerprint(None, 0, screencasts=True)
    assert recorded["screencast_font"] == here
    assert "screencast_font" not in data_fingerprint(None, 0)  # SFT and RL data hold no screencast
    dejavu = Path(matplotlib.get_data_path()) / "fonts" / "ttf"  # matplotlib ships DejaVu Sans
    for folders, family in (([dejavu], "DejaVu Sans"), ([], BUILTIN_FONT)):
        fonts(folders)
        with pytest.warns(UserWarning, match=f"not installed: screencast frames are drawn in {family}.*fonts-liberation"):
            assert screencast_font() == family
        other = np.asarray(render_frame(spec, 160, 120))
        assert other.shape == drawn.shape and (family == here or not np.array_equal(other, drawn))
        assert fingerprint_changes(recorded, data_fingerprint(None, 0, screencasts=True)) == (
            [] if family == here else [f"the embedded screencasts are drawn in {family}, not {here} (see the fonts "
                                       "installed)"])
        older = {k: v for k, v in recorded.items() if k != "screencast_font"}  # checkpoints that predate the field
        assert fingerprint_changes(older, data_fingerprint(None, 0, screencasts=True)) == []
