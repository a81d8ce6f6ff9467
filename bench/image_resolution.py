"""What the model's image processor leaves of the MathVista proxy's images at a patch budget (no model involved).

For each `--max-patches` budget, the held-out proxy items' images are resized as `MoonViTImageProcessor` resizes
them (`fit_to_patch_budget`: 14-pixel patches, 2x2 merge), and the script prints, over the items:
- the height in pixels of a printed digit (the 10-pixel font of the bar values and side lengths, glyph box of
  "0".."9") after the resize, on the chart and diagram items (math-targeted-vqa);
- the side in pixels of the smallest object to count after the resize, on the counting items (general-vqa);
- the merged image tokens per image (what the language model reads).
`--montage` saves one item of each kind (two charts, a rectangle, a counting scene) at each budget side by side,
as the model's input (upscaled 2x for viewing).

    python bench/image_resolution.py --max-patches 64 144 --montage docs/img/mathvista_patch_budget.png
"""

from __future__ import annotations

import argparse
import statistics

from PIL import Image, ImageFont

from kimi_vl.data.world import make_samples
from kimi_vl.eval.proxies import MATHVISTA_SYNTH_SIZE, PROXY_SEED
from kimi_vl.vision.image_processing import fit_to_patch_budget

PATCH, MERGE = 14, 2


def model_size(image: Image.Image, max_patches: int) -> tuple[int, int]:
    """`(width, height)` of `image` as the processor feeds it to the vision tower at `max_patches`."""
    (h, w), _ = fit_to_patch_budget(image.height, image.width, patch_size=PATCH, merge_size=MERGE,
                                    max_patches=max_patches, max_side_patches=512)
    return w, h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-patches", type=int, nargs="+", default=[64, 144])
    ap.add_argument("--split", choices=("eval", "val"), default="eval")
    ap.add_argument("--montage", help="save an item of each kind at each budget to this PNG")
    args = ap.parse_args()
    samples = make_samples(("visual_math",), MATHVISTA_SYNTH_SIZE, PROXY_SEED, args.split)
    x0, y0, x1, y1 = ImageFont.load_default(10).getbbox("0123456789")  # the world's chart and diagram labels
    digit = y1 - y0
    print(f"MathVista proxy ({args.split} items): {len(samples)} images, printed digits {digit} px tall as drawn.\n")
    print("| patch budget | digit height (px, median [min, max]) | smallest object to count (px, median) | "
          "image tokens (median) |")
    print("|---|---|---|---|")
    shown = [next(s for s in samples if s.meta["kind"] == k) for k in ("bar_sum", "bar_max", "rect", "count_free")]
    rows = []
    for budget in args.max_patches:
        digits, objects, tokens = [], [], []
        for s in samples:
            w, h = model_size(s.image, budget)
            scale = w / s.image.width
            tokens.append((w // PATCH) * (h // PATCH) // MERGE**2)
            if s.meta["category"] == "general-vqa":
                objects.append(scale * min(o["box"][2] - o["box"][0] for o in s.meta["objects"]))
            else:
                digits.append(scale * digit)
        print(f"| {budget} | {statistics.median(digits):.1f} [{min(digits):.1f}, {max(digits):.1f}] | "
              f"{statistics.median(objects):.1f} | {statistics.median(tokens):.0f} |")
        rows.append([s.image.resize(model_size(s.image, budget), Image.BICUBIC) for s in shown])
    if args.montage:
        cells = [[im.resize((2 * im.width, 2 * im.height), Image.NEAREST) for im in row] for row in rows]
        width = max(sum(im.width + 8 for im in row) for row in cells)
        canvas = Image.new("RGB", (width, sum(max(im.height for im in row) + 8 for row in cells)), "white")
        y = 0
        for row in cells:
            x = 0
            for im in row:
                canvas.paste(im, (x, y))
                x += im.width + 8
            y += max(im.height for im in row) + 8
        canvas.save(args.montage)
        print(f"\nmontage (rows: budgets {args.max_patches}; 2x upscaled): {args.montage}")


if __name__ == "__main__":
    main()
