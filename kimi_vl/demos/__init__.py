"""Demos: video to website (`kimi-vl demo video2web`).

- `kimi_vl.demos.video2web`: the pipeline (`run_video2web`) and its CLI parser (`add_video2web_parser`).
- `kimi_vl.demos.html_repair`: `repair_html`, any text -> a well-formed HTML document.
- `kimi_vl.demos.render`: `render_html`, headless-Chromium screenshots.
- `kimi_vl.demos.similarity`: `page_similarity`, the visual similarity of a page and a video's frames.

The submodules are imported lazily (the pipeline pulls in the model and the data layer).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BrowserError",
    "BrowserNotFoundError",
    "Video2WebResult",
    "add_video2web_parser",
    "page_similarity",
    "render_html",
    "repair_html",
    "run_video2web",
]

_WHERE = {
    "BrowserError": "render",
    "BrowserNotFoundError": "render",
    "render_html": "render",
    "repair_html": "html_repair",
    "page_similarity": "similarity",
    "Video2WebResult": "video2web",
    "add_video2web_parser": "video2web",
    "run_video2web": "video2web",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
