"""Headless Chromium rendering (kimi_vl.demos.render) and the similarity metric on real screenshots."""

import os
import random
import stat
import time

import numpy as np
import pytest

from kimi_vl.data.screencast import make_screencast, render_frame, write_video
from kimi_vl.demos.render import BrowserError, BrowserNotFoundError, find_chromium, render_html
from kimi_vl.demos.similarity import page_similarity
from kimi_vl.errors import KimiVLError
from kimi_vl.vision.media import load_video

KNOWN_PAGE = """<!DOCTYPE html><html><body style="margin:0;background:#ffffff">
<div style="position:absolute;left:0;top:0;width:50px;height:40px;background:#ff0000"></div>
<div style="position:absolute;left:50px;top:0;width:50px;height:40px;background:#00ff00"></div>
<div style="position:absolute;left:0;top:40px;width:100px;height:20px;background:#0000ff"></div>
<div style="position:absolute;right:0;bottom:0;width:10px;height:10px;background:#000000"></div>
</body></html>"""


def test_known_page_pixels(chromium, tmp_path):
    # 130 x 70: smaller than Chromium's minimum window; the right/bottom-anchored box checks the exact viewport
    img = np.asarray(render_html(KNOWN_PAGE, 130, 70))
    assert img.shape == (70, 130, 3)
    expect = {(10, 10): (255, 0, 0), (75, 30): (0, 255, 0), (50, 50): (0, 0, 255), (120, 10): (255, 255, 255),
              (125, 65): (0, 0, 0), (115, 65): (255, 255, 255), (120, 59): (255, 255, 255), (49, 39): (255, 0, 0),
              (50, 39): (0, 255, 0), (99, 59): (0, 0, 255), (100, 59): (255, 255, 255)}
    for (x, y), rgb in expect.items():
        assert tuple(img[y, x]) == rgb, (x, y)
    # a file path works too
    page = tmp_path / "known.html"
    page.write_text(KNOWN_PAGE)
    assert np.array_equal(np.asarray(render_html(page, 130, 70)), img)


def test_pillow_frames_approximate_chromium(chromium):
    for seed in (0, 1):
        sc = make_screencast(random.Random(seed), width=160, height=120, num_frames=1)
        shot = np.asarray(render_html(sc.html, 160, 120)).astype(np.int16)
        drawn = np.asarray(render_frame(sc.spec, 160, 120)).astype(np.int16)
        diff = np.abs(shot - drawn).max(-1)
        assert diff.mean() < 8.0 and (diff > 64).mean() < 0.05, (seed, diff.mean(), (diff > 64).mean())


def test_similarity_ranks_the_true_page_first(chromium, tmp_path):
    sc = make_screencast(random.Random(11), width=160, height=120, num_frames=8)
    other = make_screencast(random.Random(12), width=160, height=120, num_frames=1)
    frames = list(load_video(write_video(sc.frames, tmp_path / "cast.mp4", sc.fps)).frames)
    tall = 4 * 120
    true = page_similarity(frames, render_html(sc.html, 160, tall))
    wrong = page_similarity(frames, render_html(other.html, 160, tall))
    blank = page_similarity(frames, render_html("<html><body></body></html>", 160, tall))
    assert true.score > 0.9
    assert true.score > wrong.score + 0.15 and true.score > blank.score + 0.2
    assert true.offsets[0] == 0 and true.offsets == sorted(true.offsets)


def test_missing_browser_message(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_VL_CHROMIUM", str(tmp_path / "no-such-browser"))
    with pytest.raises(BrowserNotFoundError, match="apt-get install -y chromium") as info:
        find_chromium()
    assert isinstance(info.value, KimiVLError)
    monkeypatch.delenv("KIMI_VL_CHROMIUM")
    monkeypatch.setenv("PATH", str(tmp_path))
    if not any(os.path.exists(f"/usr/bin/{n}") for n in ("chromium", "chromium-browser", "google-chrome",
                                                          "google-chrome-stable")):
        with pytest.raises(BrowserNotFoundError, match="apt-get install"):
            render_html("<p>x</p>", 10, 10)


def test_hanging_browser_is_killed(tmp_path):
    fake = tmp_path / "fake-chromium"
    fake.write_text("#!/bin/sh\nsleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    start = time.monotonic()
    with pytest.raises(BrowserError, match="did not finish"):
        render_html("<p>x</p>", 32, 32, browser=str(fake), timeout=1.0)
    assert time.monotonic() - start < 10
    broken = tmp_path / "broken-chromium"
    broken.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(BrowserError, match="boom"):
        render_html("<p>x</p>", 32, 32, browser=str(broken), timeout=10.0)
