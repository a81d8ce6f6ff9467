"""Screenshots of HTML pages with headless Chromium (a subprocess with a timeout; nothing here can hang).

`render_html(page, width, height)` loads a page (an HTML string or a file) in a fresh headless Chromium, device scale
factor 1, no scrollbars, a throw-away profile, no network (every host name resolves to nothing), and returns the
screenshot as an RGB Pillow image of exactly `width x height`. Chromium's window has a minimum width (~500 px) and
its viewport is shorter than its `--window-size` (the viewport of a 160 x 120 window measures 500 x 33), so the page
is not loaded as the top document: a host page holds it in an iframe of exactly `width x height` (the page's
viewport: `100vw`, `100vh` and percentages behave as in a browser window of that size), in a larger window, and the
screenshot is cropped to the iframe.

The browser is found by `find_chromium()`: `$KIMI_VL_CHROMIUM`, then `chromium`, `chromium-browser`,
`google-chrome`, `google-chrome-stable` on `PATH`. When none is installed a `BrowserNotFoundError` says how to
install one (Debian/Ubuntu: `apt-get install -y chromium`).
"""

from __future__ import annotations

import html
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from PIL import Image

from ..errors import ConfigError, KimiVLError

__all__ = ["BrowserError", "BrowserNotFoundError", "find_chromium", "render_html"]

_MIN_WINDOW_WIDTH = 800
_WINDOW_MARGIN = 200  # extra window height: the browser's viewport is shorter than its window
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = (
    "install Chromium (Debian/Ubuntu: `sudo apt-get install -y chromium`; as root without sudo: "
    "`apt-get install -y chromium`), or point $KIMI_VL_CHROMIUM at a Chrome/Chromium executable"
)


class BrowserError(KimiVLError, RuntimeError):
    """Headless Chromium failed or timed out while rendering a page."""


class BrowserNotFoundError(BrowserError, FileNotFoundError):
    """No Chromium / Chrome executable was found."""


def find_chromium(explicit: str | os.PathLike | None = None) -> str:
    """Path of the Chromium executable: `explicit`, else `$KIMI_VL_CHROMIUM`, else the first of `chromium`,
    `chromium-browser`, `google-chrome`, `google-chrome-stable` found on `PATH` (or in /usr/bin).

    Raises:
        BrowserNotFoundError: none found, with the install command.
    """
    wanted = explicit or os.environ.get("KIMI_VL_CHROMIUM")
    if wanted:
        path = shutil.which(os.fspath(wanted))
        if path is None:
            raise BrowserNotFoundError(f"the browser {os.fspath(wanted)!r} is not an executable; {INSTALL_HINT}.")
        return path
    for name in _CANDIDATES:
        path = shutil.which(name) or shutil.which(name, path="/usr/bin")
        if path:
            return path
    raise BrowserNotFoundError(f"headless rendering needs Chromium, which is not installed; {INSTALL_HINT}.")


def _command(browser: str, url: str, screenshot: Path, width: int, height: int, profile: Path) -> list[str]:
    return [
        browser,
        "--headless",
        "--no-sandbox",  # needed as root (containers, CI); the page is a static, script-free file
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-sync",
        "--mute-audio",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # no network: every host name fails to resolve
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        f"--screenshot={screenshot}",
        url,
    ]


def _fit(image: Image.Image, width: int, height: int) -> Image.Image:
    """The top-left `width x height` of the screenshot (where the iframe holding the page is), as RGB."""
    return image.convert("RGB").crop((0, 0, width, height))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the session `proc` leads (the browser started here and its helper processes), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def render_html(
    page: str | os.PathLike,
    width: int,
    height: int,
    *,
    timeout: float = 60.0,
    browser: str | os.PathLike | None = None,
) -> Image.Image:
    """Screenshot of a page in a `width x height` viewport.

    Args:
        page: a path to an HTML file, or the HTML text itself (a `str` that is not an existing file's path).
        width, height: viewport size in CSS px (device scale factor 1, so also in pixels).
        timeout: seconds before the browser is killed and `BrowserError` raised.
        browser: Chromium executable (default: `find_chromium()`).

    Returns:
        RGB image `width x height`.

    Raises:
        BrowserNotFoundError: Chromium is not installed.
        BrowserError: the browser failed, timed out, or wrote no screenshot.
        ValueError (ConfigError): non-positive size.
    """
    if width <= 0 or height <= 0 or width > 16384 or height > 16384:
        raise ConfigError(f"viewport {width}x{height} must be within 1..16384 px per side.")
    exe = find_chromium(browser)
    with tempfile.TemporaryDirectory(prefix="kimi_vl_render_") as tmp:
        tmpdir = Path(tmp)
        if isinstance(page, os.PathLike) or (isinstance(page, str) and "<" not in page and Path(page).is_file()):
            source = Path(page).resolve()
            if not source.is_file():
                raise BrowserError(f"page {str(source)!r} does not exist; pass an HTML file or the HTML text.")
        else:
            source = tmpdir / "page.html"
            source.write_text(str(page), encoding="utf-8")
        # Chromium's window has a minimum size (about 500 px wide) and its viewport is smaller than the window, so
        # the page is shown in an iframe of exactly width x height inside a larger host page, cropped afterwards.
        host = tmpdir / "host.html"
        host.write_text(
            '<!DOCTYPE html><html><body style="margin:0;background:#fff">'
            f'<iframe src="{html.escape(source.as_uri(), quote=True)}" scrolling="no" '
            f'style="display:block;border:0;width:{width}px;height:{height}px"></iframe></body></html>',
            encoding="utf-8",
        )
        shot = tmpdir / "shot.png"
        window = (max(width, _MIN_WINDOW_WIDTH), height + _WINDOW_MARGIN)
        cmd = _command(exe, host.as_uri(), shot, *window, tmpdir / "profile")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise BrowserError(
                f"Chromium did not finish rendering within {timeout:g} s; raise the timeout or check that "
                f"`{exe} --headless --screenshot` works on this machine."
            ) from None
        finally:
            _kill_group(proc)  # helpers the browser left behind in its session
        if not shot.is_file():
            tail = "\n".join(err.decode("utf-8", "replace").strip().splitlines()[-5:])
            raise BrowserError(
                f"Chromium (exit code {proc.returncode}) wrote no screenshot; its last messages:\n{tail}\n"
                f"check that `{exe} --headless --no-sandbox --screenshot` works on this machine."
            )
        with Image.open(shot) as image:
            if image.width < width or image.height < height:
                raise BrowserError(
                    f"Chromium's screenshot is {image.width}x{image.height}, smaller than the {width}x{height} page "
                    f"it was asked for (window {window[0]}x{window[1]}); check the browser version."
                )
            return _fit(image, width, height)
