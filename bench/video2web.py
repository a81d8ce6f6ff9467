"""Video-to-website quality of a trained model on held-out generated screencasts.

For each of `--n` screencasts (seeds disjoint from every training seed) the demo generates `site.html` from the
video, renders it in headless Chromium and scores it against the frames (`kimi_vl.demos.similarity`). Anchors on the
same frames: a blank white page (the floor), the screencast's true HTML rendered the same way (the ceiling), and
the constant-answer baseline: `FIXED_PAGES` fixed pages (true pages of training screencasts, the same for every
video; `kimi_vl.demos.video2web.fixed_page_scores`), their mean and the best of them. Prints the mean scores, the
share of the blank-to-true gap each closes, and on how many screencasts the model is ahead of the blank page and
of the fixed pages' mean; how many different pages the model wrote for the `--n` videos; then the fields of the page
it states right (title, colours and sizes, `page_fields_read`: what the page read from the video, which the
similarity only partly shows) against the fixed pages'.

`--field-worth` also scores what reading each kind of field is worth: every fixed page with the screencast's true
colours put in, and with its true sizes (heights, button width) put in, each as a share of the blank-to-true gap.
`--split val` draws the screencasts from the world's validation split instead of the held-out eval split: for
choosing settings without looking at the reported figure.

    python bench/video2web.py --model runs/quickstart/model [--n 10] [--split val] [--field-worth]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
from pathlib import Path

import numpy as np

from kimi_vl.data.screencast import PageSpec, page_html, write_video
from kimi_vl.data.world import make_sample
from kimi_vl.demos.similarity import gap_closed
from kimi_vl.demos.video2web import (
    FIXED_PAGES,
    PAGE_FIELDS,
    blank_page_score,
    fixed_page_scores,
    fixed_page_specs,
    fixed_pages,
    load_model,
    page_fields_read,
    page_scores,
    render_and_score,
    run_video2web,
)
from kimi_vl.quickstart import DEMO_SEED

COLORS = (("header_color", "button_color"), "color")
SIZES = (("header_height", "button_width"), "height")
"""`PageSpec` attributes of one kind of field: the page's own, and each section's."""


def with_fields(page: PageSpec, true: PageSpec, kind: tuple[tuple[str, ...], str]) -> PageSpec:
    """`page` with the fields of `kind` (`COLORS` or `SIZES`) taken from `true`."""
    own, section = kind
    sections = tuple(dataclasses.replace(s, **{section: getattr(t, section)})
                     for s, t in zip(page.sections, true.sections, strict=True))
    return dataclasses.replace(page, sections=sections, **{name: getattr(true, name) for name in own})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--split", choices=("eval", "val"), default="eval", help="the world's split of the screencasts")
    ap.add_argument("--field-worth", action="store_true",
                    help="also score the fixed pages with the true colours, and with the true sizes, put in")
    args = ap.parse_args()
    model, processor = load_model(args.model)
    model_scores, blank_scores, true_scores, fixed_scores = [], [], [], []
    color_scores, size_scores = [], []  # per screencast: mean over the fixed pages with that field kind put in
    model_reads, fixed_reads = [], []  # per screencast: {field: right?}; the fixed pages' pooled over the pages
    pages = []
    fixed, specs = fixed_pages(), fixed_page_specs()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.n):
            work = Path(tmp) / str(i)
            work.mkdir()
            cast = make_sample("screencast", random.Random(DEMO_SEED + 1 + i), split=args.split).video
            video = write_video(cast.frames, work / "cast.mp4", cast.fps)
            frames = np.stack([np.asarray(f) for f in cast.frames])  # the page and its anchors on the same frames
            result = run_video2web(video, args.model, work / "model", render=True, max_new_tokens=256, model=model,
                                   processor=processor, score_frames=frames)
            (work / "true.html").write_text(cast.html)
            true_score = render_and_score(work / "true.html", frames, work / "true")[3]["score"]
            blank = blank_page_score(frames)
            model_scores.append(result.score["score"])
            blank_scores.append(blank)
            true_scores.append(true_score)
            fixed_scores.append(fixed_page_scores(frames, work))
            model_reads.append(page_fields_read(result.html, cast.spec))
            fixed_reads += [page_fields_read(page, cast.spec) for page in fixed]
            pages.append(result.html)
            if args.field_worth:
                color_scores.append(statistics.fmean(page_scores(
                    [page_html(with_fields(s, cast.spec, COLORS)) for s in specs], frames, work, prefix="colors")))
                size_scores.append(statistics.fmean(page_scores(
                    [page_html(with_fields(s, cast.spec, SIZES)) for s in specs], frames, work, prefix="sizes")))
            print(f"screencast {i}: model {model_scores[-1]:.3f}  blank {blank:.3f}  true html {true_score:.3f}  "
                  f"fixed pages {statistics.fmean(fixed_scores[-1]):.3f} (mean of {FIXED_PAGES})  "
                  f"(stop: {result.stop})", flush=True)
    m, b, t = (statistics.fmean(x) for x in (model_scores, blank_scores, true_scores))
    per_page = [statistics.fmean(s[j] for s in fixed_scores) for j in range(FIXED_PAGES)]
    f_mean, f_best = statistics.fmean(per_page), max(per_page)
    wins = sum(a > c for a, c in zip(model_scores, blank_scores))
    wins_fixed = sum(a > statistics.fmean(s) for a, s in zip(model_scores, fixed_scores))
    print(f"mean similarity over {args.n} {args.split} screencasts: model {m:.3f}, blank white page {b:.3f}, "
          f"true HTML {t:.3f}; model - blank = {m - b:+.3f} (model ahead on {wins}/{args.n}); "
          f"fraction of the blank-to-true gap closed: {gap_closed(m, b, t):.2f}")
    print(f"constant-answer baseline, {FIXED_PAGES} fixed pages (true pages of training screencasts): mean "
          f"{f_mean:.3f} (gap closed {gap_closed(f_mean, b, t):.2f}), best page {f_best:.3f} (gap closed "
          f"{gap_closed(f_best, b, t):.2f}); model - fixed pages' mean = {m - f_mean:+.3f} (model ahead on "
          f"{wins_fixed}/{args.n})")
    print(f"different pages the model wrote: {len(set(pages))} for {args.n} screencasts")
    print("fields the page states right (the model's page | the fixed pages; chance 1/16 for the title, 1/12 for a "
          "colour, 1/4 for the header height, 1/10 for a section height, 1/5 for the button width): " + ", ".join(
              f"{name} {100 * statistics.fmean(r[name] for r in model_reads):.0f}% | "
              f"{100 * statistics.fmean(r[name] for r in fixed_reads):.0f}%" for name in PAGE_FIELDS))
    if args.field_worth:
        c, s = statistics.fmean(color_scores), statistics.fmean(size_scores)
        print(f"what reading a kind of field is worth: the fixed pages with the true colours {c:.3f} (gap closed "
              f"{gap_closed(c, b, t):.2f}), with the true sizes {s:.3f} (gap closed {gap_closed(s, b, t):.2f}); "
              f"as they are {f_mean:.3f} ({gap_closed(f_mean, b, t):.2f})")


if __name__ == "__main__":
    main()
