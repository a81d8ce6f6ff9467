"""The visual similarity metric (kimi_vl.demos.similarity), without a browser."""

import random

import numpy as np
import pytest
from PIL import Image

from kimi_vl.data.screencast import make_screencast, page_height, random_page, render_frame
from kimi_vl.demos.similarity import colour_layout, image_similarity, page_similarity, ssim, structure
from kimi_vl.errors import ConfigError


def test_terms_on_simple_images():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    assert image_similarity(noise, noise) == pytest.approx(1.0)
    white = np.full((60, 80, 3), 255, np.uint8)
    black = np.zeros((60, 80, 3), np.uint8)
    assert colour_layout(white, black) == pytest.approx(0.0)
    assert structure(white, black) < 0.01
    assert image_similarity(white, black) < 0.01
    x = rng.random((20, 30))
    assert ssim(x, x) == pytest.approx(1.0)
    assert ssim(x, 1 - x) < 0
    stack = ssim(np.stack([x, 1 - x, x]), x)
    assert stack.shape == (3,) and stack[0] == pytest.approx(1.0) and stack[1] < 0
    with pytest.raises(ConfigError):
        ssim(x, x[:10])


def test_page_similarity_follows_the_scroll():
    spec = random_page(random.Random(2))
    w, h = 160, 120
    full_height = page_height(spec, w)
    page = render_frame(spec, w, full_height)  # the whole page at once
    scrolls = [0, 5, 10, full_height - h]
    frames = [render_frame(spec, w, h, scroll=s) for s in scrolls]
    result = page_similarity(frames, page)
    assert result.score > 0.97
    assert np.abs(np.array(result.offsets) - scrolls).max() <= 3  # windows every 160 / 64 = 2.5 px
    assert page_similarity(frames[:1], page.crop((0, 0, w, h))).score == pytest.approx(
        image_similarity(frames[0], page.crop((0, 0, w, h))))
    # a screen-sized page has one window: scrolled frames then score lower
    assert page_similarity(frames, page.crop((0, 0, w, h))).score < 0.95
    other = render_frame(random_page(random.Random(3)), w, full_height)
    blank = Image.new("RGB", (w, full_height), "white")
    assert page_similarity(frames, other).score < result.score - 0.2
    assert page_similarity(frames, blank).score < result.score - 0.3
    d = result.to_dict()
    assert set(d) >= {"score", "structure", "colour_layout", "frame_scores", "offsets", "metric"}


def test_page_similarity_errors():
    frames = make_screencast(random.Random(0), width=64, height=48, num_frames=2).frames
    with pytest.raises(ConfigError, match="at least one frame"):
        page_similarity([], frames[0])
    with pytest.raises(ConfigError, match="render the page"):
        page_similarity(frames, Image.new("RGB", (80, 200)))
    with pytest.raises(ConfigError, match="one size"):
        page_similarity([frames[0], frames[1].resize((32, 24))], frames[0])


@pytest.mark.parametrize("size", [(1000, 20), (640, 70), (1920, 200)])
def test_colour_layout_of_a_wide_frame_stays_in_range(size):
    """A frame wider than about 8.5 : 1 is reduced to under 8 rows, so some of the 8 x 8 cells are empty: the term is
    the mean over the cells that hold pixels, still 0 for black against white and 1/2 against mid grey."""
    black, white, grey = (Image.new("RGB", size, c) for c in ("black", "white", (128, 128, 128)))
    assert colour_layout(black, white) == pytest.approx(0.0, abs=1e-12)
    assert colour_layout(black, grey) == pytest.approx(1 - 128 / 255)
    assert colour_layout(black, black) == 1.0
    assert 0.0 <= page_similarity([black], white).score <= 1.0
    stripes = np.zeros((size[1], size[0], 3), np.uint8)
    stripes[:, : size[0] // 2] = 255  # left half white: half of the filled cells differ completely from black
    assert colour_layout(black, stripes) == pytest.approx(0.5)
