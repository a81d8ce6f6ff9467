"""Shared fixtures of the demo tests: whether Chromium is installed."""

import pytest

from kimi_vl.demos.render import BrowserNotFoundError, find_chromium


def chromium_or_none() -> str | None:
    try:
        return find_chromium()
    except BrowserNotFoundError:
        return None


@pytest.fixture(scope="session")
def chromium() -> str:
    path = chromium_or_none()
    if path is None:
        pytest.skip("Chromium is not installed (Debian/Ubuntu: apt-get install -y chromium; CI installs it)")
    return path
