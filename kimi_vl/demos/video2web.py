"""Video to website: a screen recording of a web page -> the HTML of that page (`kimi-vl demo video2web`).

Pipeline (`run_video2web`):

1. Model: a saved Kimi-VL directory (`config.json` of model_type `kimi_vl`, weights, processor and tokenizer files).
   A missing directory or missing files raise `CheckpointError`; a model without a vision encoder (e.g. a
   `kimi_vl_text` checkpoint) or a processor without a video processor raises `ConfigError`.
2. Video: decoded with decord (`kimi_vl.vision.load_video`; GIF animations with Pillow), sampled by `fps` or
   `num_frames` (default: the video processor's `fps`). The sample is kept within the media budget: at most the video
   processor's `max_frames` frames, each within its `max_patches` patch budget, and at most `max_video_tokens` vision
   tokens in all (default `DEFAULT_MAX_VIDEO_TOKENS`); a long video gets fewer, still uniformly spaced, frames (whole
   chunks of `temporal_patch_size` frames). Corrupt, empty or unreadable videos raise `InvalidMediaError`.
3. Prompt: the processor's chat template with one user turn `[video, SCREENCAST_QUESTION]`
   (`kimi_vl.data.world.SCREENCAST_QUESTION`, the question the training data asks) and the assistant
   header;
   the processor expands the video into per-chunk MoonViT-3D media blocks.
4. Generation: `model.generate` (greedy by default) stops at `</html>` (a stopping criterion on the decoded text),
   at `<|im_end|>` / the end-of-document token (eos ids), or after `max_new_tokens`.
5. Output: the reply is repaired into a well-formed document (`kimi_vl.demos.html_repair.repair_html`) and written
   to `OUT_DIR/site.html` (the raw reply to `OUT_DIR/reply.txt`).
6. `render=True`: `site.html` is rendered by headless Chromium at the video's frame size (`render.png`) and as a
   taller page (8 frame heights, at most 8192 px) for the score; `compare.png` shows the first sampled frame next
   to the render; `score.json` holds `kimi_vl.demos.similarity.page_similarity` between the frames and the page.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from transformers import StoppingCriteriaList

from ..data.screencast import SECTIONS, PageSpec, page_html
from ..data.world import SCREENCAST_QUESTION, make_sample, sample_rng
from ..errors import CheckpointError, ConfigError, InvalidMediaError
from ..eval.generation import StopOnStrings, eos_token_ids
from ..eval.report import make_output_dir
from ..options import positive_int
from ..vision.media import VideoFrames, load_video
from ..vision.video_processing import clip_metadata
from .html_repair import repair_html

if TYPE_CHECKING:
    from ..modeling import KimiVLForConditionalGeneration
    from ..processing import KimiVLProcessor

__all__ = [
    "DEFAULT_MAX_VIDEO_TOKENS",
    "FIXED_PAGES",
    "Video2WebResult",
    "add_video2web_parser",
    "build_prompt",
    "fixed_page_scores",
    "fixed_page_specs",
    "fixed_pages",
    "generate_html",
    "load_model",
    "page_fields",
    "page_fields_read",
    "page_scores",
    "read_video",
    "render_and_score",
    "run_video2web",
]

DEFAULT_MAX_VIDEO_TOKENS = 2048
"""Default cap on the vision tokens of the video (all chunks together)."""
RENDER_HEIGHT_FACTOR = 8
MAX_RENDER_HEIGHT = 8192
HTML_END = "</html>"
RENDER_FILES = ("render.png", "compare.png", "score.json")
"""What `render=True` writes beside `site.html` (removed first when a run writes a new page into the folder)."""


@dataclass
class Video2WebResult:
    """What `run_video2web` produced.

    Attributes:
        site: path of `site.html`; `html` its text (the repaired document); `reply` the model's raw reply.
        stop: why generation stopped: "html_end" (`</html>`), "eos" (`<|im_end|>` / end of document) or
            "max_new_tokens" (the reply was cut; the repair closed what was open).
        num_frames, frame_size: sampled frames and their `(width, height)`; `video_tokens`: vision tokens used.
        new_tokens: generated tokens.
        render, compare, score_file: paths written with `render=True` (else None); `score`: the score dict.
    """

    site: Path
    html: str
    reply: str
    stop: str
    num_frames: int
    frame_size: tuple[int, int]
    video_tokens: int
    new_tokens: int
    render: Path | None = None
    compare: Path | None = None
    score_file: Path | None = None
    score: dict[str, Any] | None = field(default=None)


# ----------------------------------------------------------------------------------------------------- model
def load_model(
    model_dir: str | Path, *, device: str | torch.device | None = None, dtype: str = "float32"
) -> tuple[KimiVLForConditionalGeneration, KimiVLProcessor]:
    """Load `(model, processor)` from a saved Kimi-VL directory (`kimi_vl.eval.generation.Engine.from_pretrained`),
    checking that it can read videos. `device`: default CUDA when available.

    Raises:
        CheckpointError: the directory or its config / weights / processor files are missing or unreadable.
        ConfigError: the model has no vision encoder, or the processor no video processor; a `device` this machine
            does not have (`kimi_vl.eval.generation.resolve_device`, the check `kimi-vl eval` makes too).
    """
    from ..eval.generation import Engine

    path = Path(model_dir)
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(config_file)!r} is not readable JSON ({exc}); re-save the model.") from exc
    if config and (config.get("model_type") != "kimi_vl" or not isinstance(config.get("vision_config"), dict)):
        raise ConfigError(
            f"the model in {str(path)!r} (model_type {config.get('model_type')!r}) has no vision encoder, so it "
            "cannot read a video; use a Kimi-VL model (model_type 'kimi_vl', e.g. from `kimi-vl train pretrain`).")
    engine = Engine.from_pretrained(path, device=None if device is None else str(device), dtype=dtype)
    if getattr(engine.processor, "video_processor", None) is None:
        raise ConfigError(f"the processor in {str(path)!r} has no video processor; save a KimiVLProcessor built "
                          "with a MoonViTVideoProcessor.")
    return engine.model.eval(), engine.processor


# ----------------------------------------------------------------------------------------------------- video
def _video_setting(processor: Any, name: str) -> Any:
    return getattr(processor.video_processor, name)


def read_video(
    video: str | Path,
    processor: Any,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int | None = None,
    max_video_tokens: int | None = DEFAULT_MAX_VIDEO_TOKENS,
) -> VideoFrames:
    """Decode and sample a video within the media budget (module docstring, step 2).

    Args:
        video: path of the video file.
        processor: the model's `KimiVLProcessor` (its video processor gives `fps`, `max_frames`, `max_patches`).
        fps: frames per second to sample (default: the video processor's); ignored when `num_frames` is given.
        num_frames: exact number of uniformly spaced frames (still capped by the budget).
        max_frames: cap on frames (default: the video processor's `max_frames`).
        max_video_tokens: cap on vision tokens (None: no cap besides `max_frames`).

    Returns:
        `VideoFrames` (frames `[T, H, W, 3]` uint8, source timestamps and indices).

    Raises:
        InvalidMediaError: missing / empty / corrupt video, or a frame size whose single chunk exceeds the budget.
        ConfigError: non-positive settings.
    """
    if max_video_tokens is not None and max_video_tokens <= 0:
        raise ConfigError(f"max_video_tokens must be positive, got {max_video_tokens}.")
    probe = load_video(video, num_frames=1)  # decodes one frame: size, length, frame rate; raises on bad files
    _, height, width, _ = probe.frames.shape
    vp = processor.video_processor
    cap = int(max_frames if max_frames is not None else _video_setting(processor, "max_frames"))
    if max_video_tokens is not None:
        chunk = int(vp.temporal_patch_size)
        per_chunk = vp.get_num_video_tokens(1, height, width)
        if per_chunk > max_video_tokens:
            raise InvalidMediaError(
                f"one chunk of this {width}x{height} video costs {per_chunk} vision tokens, over the budget of "
                f"{max_video_tokens}; raise max_video_tokens or lower the video processor's max_patches."
            )
        cap = min(cap, (max_video_tokens // per_chunk) * chunk)
    if num_frames is not None:
        if num_frames > cap:
            raise ConfigError(
                f"num_frames={num_frames} is over the media budget of {cap} frames for this {width}x{height} video "
                f"(max_frames / max_video_tokens={max_video_tokens}); ask for fewer frames or raise the budget."
            )
        return load_video(video, num_frames=num_frames, max_frames=cap)
    rate = fps if fps is not None else _video_setting(processor, "fps")
    return load_video(video, fps=rate, max_frames=cap)


def build_prompt(processor: Any) -> str:
    """The chat prompt: one user turn `[video, SCREENCAST_QUESTION]` and the assistant header (placeholders
    unexpanded), as the chat-form training samples of the screencast task."""
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": SCREENCAST_QUESTION}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _model_inputs(processor: Any, clip: VideoFrames) -> dict[str, torch.Tensor]:
    """Processor outputs for the prompt and the decoded frames (chunk timestamps from `clip_metadata`)."""
    inputs = processor(
        text=[build_prompt(processor)], videos=[clip.frames], video_metadata=[clip_metadata(clip)],
        do_sample_frames=False, return_tensors="pt",
    )
    keep = ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw")
    return {k: inputs[k] for k in keep if k in inputs}


# ----------------------------------------------------------------------------------------------------- generation
def generate_html(
    model: Any,
    processor: Any,
    clip: VideoFrames,
    *,
    max_new_tokens: int = 512,
    do_sample: bool = False,
    temperature: float = 1.0,
) -> tuple[str, str, int, int]:
    """Generate the page's HTML for a sampled video.

    Returns:
        `(reply, stop, new_tokens, video_tokens)`: the reply text up to and including the first `</html>`
        (special tokens removed), why generation stopped ("html_end" | "eos" | "max_new_tokens"), the number of
        generated tokens and of vision tokens in the prompt.
    """
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}.")
    if do_sample and not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be a positive number when sampling, got {temperature}; "
                          "use do_sample=False for greedy decoding.")
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in _model_inputs(processor, clip).items()}
    prompt_len = inputs["input_ids"].shape[1]
    video_tokens = int((inputs["input_ids"] == processor.video_token_id).sum())
    stops = eos_token_ids(model, processor.tokenizer)
    kwargs: dict[str, Any] = dict(do_sample=do_sample)
    if do_sample:
        kwargs["temperature"] = temperature
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, eos_token_id=stops,
            pad_token_id=processor.tokenizer.pad_token_id,
            stopping_criteria=StoppingCriteriaList([StopOnStrings(processor.tokenizer, [HTML_END], prompt_len)]),
            **kwargs,
        )
    new = out[0, prompt_len:]
    ids = new.tolist()
    reply = processor.post_process_image_text_to_text(new, skip_special_tokens=True)
    if HTML_END in reply:
        stop = "html_end"
        reply = reply[: reply.index(HTML_END) + len(HTML_END)]
    elif ids and ids[-1] in stops:
        stop = "eos"
    else:
        stop = "max_new_tokens"
    return reply, stop, len(ids), video_tokens


# ----------------------------------------------------------------------------------------------------- render
def _page_height(frame_height: int) -> int:
    """Height at which a page is rendered (and scored) for frames `frame_height` pixels tall."""
    return min(MAX_RENDER_HEIGHT, max(frame_height, RENDER_HEIGHT_FACTOR * frame_height))


def blank_page_score(frames: np.ndarray) -> float:
    """Similarity of a blank white page, of the size `render_and_score` renders, to the frames `[T, H, W, 3]`: the
    floor a generated page is measured against."""
    from .similarity import page_similarity

    _, h, w, _ = frames.shape
    return page_similarity(list(frames), Image.new("RGB", (w, _page_height(h)), "white")).score


FIXED_PAGES = 5
"""How many fixed pages `fixed_page_scores` scores by default."""


def fixed_page_specs(n: int = FIXED_PAGES) -> list[PageSpec]:
    """The page descriptions of `n` screencasts of the world's train split (fixed: the same on every call)."""
    return [make_sample("screencast", sample_rng(0, j, "fixed-page")).video.spec for j in range(n)]


def fixed_pages(n: int = FIXED_PAGES) -> list[str]:
    """The true HTML of the `fixed_page_specs(n)`: pages of the kind the demo writes that do not depend on any
    video."""
    return [page_html(spec) for spec in fixed_page_specs(n)]


def page_scores(pages: list[str], frames: np.ndarray, out_dir: str | Path, prefix: str = "page") -> list[float]:
    """Similarity of each HTML page in `pages` to the frames `[T, H, W, 3]`, rendered and scored as
    `render_and_score` does (files under `out_dir/<prefix><j>/`). Raises what `render_and_score` raises."""
    out = Path(out_dir)
    scores = []
    for j, html in enumerate(pages):
        page = out / f"{prefix}{j}" / "page.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(html)
        scores.append(render_and_score(page, frames, page.parent)[3]["score"])
    return scores


def fixed_page_scores(frames: np.ndarray, out_dir: str | Path, n: int = FIXED_PAGES) -> list[float]:
    """`page_scores` of the `fixed_pages(n)` (files under `out_dir/fixed<j>/`): the demo's constant-answer
    baseline. A page of the right kind scores well above a blank page whatever the video shows, so a generated page
    has read the video only as far as it scores above these."""
    return page_scores(fixed_pages(n), frames, out_dir, prefix="fixed")


PAGE_FIELDS = ("title", "header color", "header height",
               *(f"section {i + 1} {what}" for i in range(SECTIONS) for what in ("color", "height")),
               "button color", "button width")
"""What `page_fields_read` checks: the values a page takes from its video, each drawn uniformly (`random_page`):
the title (chance 1/16), the background colours (1/12 each), the header's height (1/4), the sections' heights (1/10
each) and the button's width (1/5). Sizes are CSS pixels, as strings."""
_TITLE = re.compile(r"<body[^>]*>\s*<div[^>]*>([^<]*)</div>")
_ELEMENT = re.compile(r'<(div|button)\b[^>]*?style="([^"]*)"')


def _style_value(style: str, prop: str) -> str | None:
    m = re.search(rf"(?:^|;)\s*{prop}:\s*([a-z]+|\d+)", style)
    return m.group(1) if m else None


def page_fields(html: str) -> dict[str, str | None]:
    """The `PAGE_FIELDS` a page states, read off its HTML as `page_html` writes it: the first `<div>`'s text (the
    title), the first `<div>` as the header, the next `SECTIONS` `<div>`s as the sections and the first `<button>`
    (their `background`, `height` and the button's `width`); None where the page has no such element or value."""
    title = _TITLE.search(html)
    elements = _ELEMENT.findall(html)
    divs = [style for tag, style in elements if tag == "div"]
    button = next((style for tag, style in elements if tag == "button"), None)
    boxes = [divs[i] if i < len(divs) else None for i in range(1 + SECTIONS)]
    values: list[str | None] = [title.group(1).strip() if title else None]
    for style in boxes:
        values += [_style_value(style, "background"), _style_value(style, "height")] if style else [None, None]
    values += [_style_value(button, "background"), _style_value(button, "width")] if button else [None, None]
    return dict(zip(PAGE_FIELDS, values, strict=True))


def page_fields_read(html: str, spec: PageSpec) -> dict[str, bool]:
    """Which of the `PAGE_FIELDS` the page `html` gets right for the screencast of `spec`: what a generated page
    read from the video, unlike the similarity score, which a page of the right kind earns whatever it states."""
    truth = page_fields(page_html(spec))
    return {name: stated == truth[name] for name, stated in page_fields(html).items()}


def render_and_score(
    site: str | Path,
    frames: np.ndarray,
    out_dir: str | Path,
    *,
    timeout: float = 60.0,
    browser: str | None = None,
) -> tuple[Path, Path, Path, dict[str, Any]]:
    """Render `site` (an HTML file) at the frames' size and score it against the frames `[T, H, W, 3]`.

    Writes `render.png` (the first `W x H` of the page rendered `_page_height(H)` px tall, as the score sees it),
    `compare.png` (first frame | render, a 4 px grey gap) and `score.json` (`PageScore.to_dict()` plus the sizes) in
    `out_dir` (created if missing). A page sized by its viewport (`vh` units, fixed elements) lays out in that tall
    window as in a tall browser window.

    Returns:
        `(render_path, compare_path, score_path, score_dict)`.

    Raises:
        BrowserNotFoundError / BrowserError (KimiVLError): Chromium missing, failing or timing out.
    """
    from .render import render_html
    from .similarity import page_similarity

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t, h, w, _ = frames.shape
    page_h = _page_height(h)
    full = render_html(Path(site), w, page_h, timeout=timeout, browser=browser)
    # the first screen: what a w x h window shows, except for a page sized by its viewport (vh units, fixed elements,
    # height media queries), which lays out in the taller window as in a taller browser window
    shot = full.crop((0, 0, w, h))
    render_path = out / "render.png"
    shot.save(render_path)
    compare = Image.new("RGB", (2 * w + 4, h), (128, 128, 128))
    compare.paste(Image.fromarray(frames[0]), (0, 0))
    compare.paste(shot, (w + 4, 0))
    compare_path = out / "compare.png"
    compare.save(compare_path)
    result = page_similarity(list(frames), full)
    score = result.to_dict()
    score.update({"frame_size": [w, h], "num_frames": int(t), "page_render_height": page_h})
    score_path = out / "score.json"
    score_path.write_text(json.dumps(score, indent=1))
    return render_path, compare_path, score_path, score


# ----------------------------------------------------------------------------------------------------- pipeline
def run_video2web(
    video: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int | None = None,
    max_video_tokens: int | None = DEFAULT_MAX_VIDEO_TOKENS,
    max_new_tokens: int = 512,
    do_sample: bool = False,
    temperature: float = 1.0,
    render: bool = False,
    device: str | None = None,
    browser: str | None = None,
    timeout: float = 60.0,
    model: Any = None,
    processor: Any = None,
    score_frames: np.ndarray | None = None,
) -> Video2WebResult:
    """Video -> `site.html` (and with `render=True` `render.png`, `compare.png`, `score.json`) in `out_dir`.

    See the module docstring for the steps. `model` / `processor` may be passed already loaded (then `model_dir`
    is not read). `score_frames` (`[T, H, W, 3]` uint8), when given, are the frames the render is scored against
    instead of those read from the video: a caller holding the video's source frames scores the page on the frames
    its baselines are scored on, not on the video codec's decoding of them. With `render=True` the browser is looked
    for first, before the model is loaded. An earlier run's
    `RENDER_FILES` in `out_dir` are removed when the new `site.html` is written. Raises `KimiVLError` subclasses:
    `CheckpointError` (model directory), `ConfigError` (model without vision, bad settings), `InvalidMediaError`
    (video), `BrowserNotFoundError` / `BrowserError` (rendering).
    """
    video_path = Path(video)
    if render:  # before the model is loaded and generates: a missing browser fails in seconds, not after a reply
        from .render import find_chromium

        find_chromium(browser)
    if model is None or processor is None:
        model, processor = load_model(model_dir, device=device)
    clip = read_video(video_path, processor, fps=fps, num_frames=num_frames, max_frames=max_frames,
                      max_video_tokens=max_video_tokens)
    reply, stop, new_tokens, video_tokens = generate_html(
        model, processor, clip, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature
    )
    document = repair_html(reply)
    out = make_output_dir(out_dir, "-o")
    for name in RENDER_FILES:  # an earlier run's render and score would sit beside this page as if they were its own
        (out / name).unlink(missing_ok=True)
    site = out / "site.html"
    site.write_text(document, encoding="utf-8", newline="")
    (out / "reply.txt").write_text(reply, encoding="utf-8", newline="")
    t, h, w, _ = clip.frames.shape
    result = Video2WebResult(
        site=site, html=document, reply=reply, stop=stop, num_frames=int(t), frame_size=(int(w), int(h)),
        video_tokens=video_tokens, new_tokens=new_tokens,
    )
    if render:
        result.render, result.compare, result.score_file, result.score = render_and_score(
            site, clip.frames if score_frames is None else score_frames, out, timeout=timeout, browser=browser
        )
    return result


# ----------------------------------------------------------------------------------------------------- CLI
def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: greedy decoding), got {text}")
    return value


def _cli(args: argparse.Namespace) -> None:
    result = run_video2web(
        args.video, args.model, args.out_dir, fps=args.fps, num_frames=args.num_frames, max_frames=args.max_frames,
        max_video_tokens=args.max_video_tokens, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
        temperature=args.temperature or 1.0, render=args.render, device=args.device, browser=args.browser,
        timeout=args.timeout,
    )
    w, h = result.frame_size
    print(f"read {result.num_frames} frames of {w}x{h} ({result.video_tokens} vision tokens); generated "
          f"{result.new_tokens} tokens (stop: {result.stop})")
    print(f"wrote {result.site}")
    if result.score is not None:
        s = result.score
        print(f"wrote {result.render}, {result.compare}, {result.score_file}")
        print(f"similarity {s['score']:.4f} (structure {s['structure']:.4f}, colour layout {s['colour_layout']:.4f})")


def add_video2web_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `video2web` command to the `demo` group's sub-parsers; it runs `run_video2web` (`args.func`)."""
    p = subparsers.add_parser(
        "video2web", help="screen recording of a web page -> site.html (optionally rendered and scored)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("video", help="video file (mp4, webm, ...) of the page")
    p.add_argument("--model", required=True, help="saved Kimi-VL model directory (with processor files)")
    p.add_argument("-o", "--out", dest="out_dir", required=True, help="output directory (site.html, reply.txt, ...)")
    p.add_argument("--fps", type=_positive_float, default=None, help="frames per second to sample "
                   "(default: the model's video processor setting)")
    p.add_argument("--num-frames", type=positive_int, default=None, help="sample this many frames instead")
    p.add_argument("--max-frames", type=positive_int, default=None, help="cap on sampled frames "
                   "(default: the video processor's max_frames)")
    p.add_argument("--max-video-tokens", type=positive_int, default=DEFAULT_MAX_VIDEO_TOKENS,
                   help="cap on vision tokens; long videos get fewer frames (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="generation length cap")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 (default): greedy; > 0: sampling")
    p.add_argument("--device", default=None, help="torch device (cpu, cuda, cuda:1, ...); default: cuda when "
                   "available")
    p.add_argument("--render", action="store_true", help="render site.html with headless Chromium: render.png, "
                   "compare.png and score.json (visual similarity to the video)")
    p.add_argument("--browser", default=None, help="Chromium executable (default: $KIMI_VL_CHROMIUM or chromium)")
    p.add_argument("--timeout", type=_positive_float, default=60.0, help="seconds allowed for the browser")
    p.set_defaults(func=_cli)
    return p
