"""`MoonViTImageProcessor`: native-resolution images -> 14x14 patches for MoonViT-3D.

Per image (read with `media.load_image`: EXIF orientation applied, converted to RGB):
1. Budget (`fit_to_patch_budget`): with `ph = max(1, H // patch)`, `pw = max(1, W // patch)`, the image is scaled
   by `s = min(1, sqrt(max_patches / (ph * pw)), side * patch / H, side * patch / W)` where `side` is
   `size["max_height"]` (patches per side), i.e. `H' = max(1, int(H * s))` (same for W), capped at `side * patch`.
   Never upscaled; the aspect ratio is kept. Resizing is bicubic with antialiasing (torchvision).
   `do_resize=False` skips this step only.
2. Padding: right and bottom with black up to a multiple of `patch * merge` (28), so every merge window is full.
   The padded grid can exceed `max_patches`, as in transformers' processor: the rule counts whole patches (floor)
   and padding rounds up (1793 x 1792 px: 128 x 128 = 16384 patches, padded 130 x 128). A very elongated image
   exceeds it far more: a side under one patch counts as one patch in `ph * pw` but is scaled by `s` too, so the
   count shrinks by `s`, not `s**2` (1 x 3000 px at `max_patches=64`: 214 patches, `s = 0.547`, 1 x 1640 px =
   117 patches), and padding then grows the short side to 28 px (2 x 118 = 236 patches; 1 x 10000 px: 2 x 214).
3. Rescale to [0, 1], normalise with `image_mean` / `image_std` (0.5 each: padded pixels become -1.0).
4. Patchify: `[3, H, W] -> [H/14 * W/14, 3, 14, 14]`, patches row-major.

Outputs (transformers' key names): `pixel_values` `[sum_i h_i * w_i, 3, 14, 14]` float32, `image_grid_thw`
`[N, 3]` int64 rows `(1, h_i, w_i)` in patches. Each image becomes `h_i * w_i / merge**2` placeholder tokens.
The settings and results are those of transformers' `Kimi_K25ImageProcessor` (the parity target).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import TorchvisionBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs
from transformers.utils import TensorType

from ..errors import ConfigError, InvalidMediaError
from .media import load_image


class MoonViTImageProcessorKwargs(ImagesKwargs, total=False):
    """Extra settings: `max_patches` (patch budget per image of the resize rule; the padded grid can exceed it, see
    the module docstring), `patch_size`, `merge_size`."""

    max_patches: int
    patch_size: int
    merge_size: int


def fit_to_patch_budget(
    height: int, width: int, *, patch_size: int, merge_size: int, max_patches: int, max_side_patches: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Resized `(H', W')` within the patch budget and the padded `(H'', W'')` (multiples of `patch * merge`).

    See the module docstring for the rule; `max_side_patches` caps each side at `max_side_patches * patch_size`
    pixels.
    """
    side_pixels = max_side_patches * patch_size
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    scale = min(1.0, math.sqrt(max_patches / patches), side_pixels / height, side_pixels / width)
    new_h = min(max(1, int(height * scale)), side_pixels)
    new_w = min(max(1, int(width * scale)), side_pixels)
    unit = patch_size * merge_size
    return (new_h, new_w), (-(-new_h // unit) * unit, -(-new_w // unit) * unit)


def patch_grid(processor: Any, height: int, width: int, overrides: dict | None = None) -> tuple[int, int]:
    """Patch grid `(h, w)` (after resizing, unless `do_resize` is off, and padding) of a `height x width` image or
    frame, with the settings of `processor` (`do_resize`, `patch_size`, `merge_size`, `max_patches`, `size`) unless
    `overrides` names them."""
    overrides = overrides or {}
    patch = overrides.get("patch_size", processor.patch_size)
    merge = overrides.get("merge_size", processor.merge_size)
    if overrides.get("do_resize", processor.do_resize):
        (height, width), _ = fit_to_patch_budget(
            height,
            width,
            patch_size=patch,
            merge_size=merge,
            max_patches=overrides.get("max_patches", processor.max_patches),
            max_side_patches=overrides.get("size", processor.size)["max_height"],
        )
    unit = patch * merge
    return -(-height // unit) * merge, -(-width // unit) * merge


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[..., C, H, W] -> [... * H/p * W/p, C, p, p]`: row-major patches of each image, images in order."""
    *lead, c, h, w = images.shape
    gh, gw = h // patch_size, w // patch_size
    x = images.reshape(-1, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(-1, c, patch_size, patch_size)


def resize_and_pad(
    processor: TorchvisionBackend,
    pixels: torch.Tensor,
    do_resize: bool,
    size: SizeDict,
    resample: PILImageResampling | int | None,
    patch_size: int,
    merge_size: int,
    max_patches: int,
) -> torch.Tensor:
    """uint8 `[..., C, H, W]` -> `[..., C, H'', W'']`: resized into the patch budget with `processor.resize` (if
    `do_resize`), then zero-padded right/bottom to multiples of `patch * merge` (always, so merge windows are full).
    """
    unit = patch_size * merge_size
    h, w = pixels.shape[-2:]
    if do_resize:
        (h, w), _ = fit_to_patch_budget(
            h,
            w,
            patch_size=patch_size,
            merge_size=merge_size,
            max_patches=max_patches,
            max_side_patches=size.max_height,
        )
        if (h, w) != tuple(pixels.shape[-2:]):
            pixels = processor.resize(pixels, size=SizeDict(height=h, width=w), resample=resample)
    return F.pad(pixels, (0, -(-w // unit) * unit - w, 0, -(-h // unit) * unit - h))


def check_not_rescaled(pixels: torch.Tensor, do_rescale: bool, kind: str) -> None:
    """Refuse float pixels `[..., C, H, W]` that all lie in [0, 1], not all 0, when `do_rescale` would divide them by
    255 again (torchvision's `to_tensor` convention): they would reach the model as a black image, silently."""
    if not (do_rescale and pixels.is_floating_point() and pixels.numel()):
        return
    if 0 <= float(pixels.min()) and 0 < float(pixels.max()) <= 1:  # an all-black image reads the same either way
        raise InvalidMediaError(
            f"{kind} pixels are floats in [0, 1] (already rescaled), but do_rescale=True divides them by 255 again; "
            "pass uint8 pixels (0..255), e.g. `(pixels * 255).round().to(torch.uint8)`, or do_rescale=False."
        )


def check_square_size(size: SizeDict | None) -> None:
    """The per-side cap is one number of patches: `size` must be `{"max_height": n, "max_width": n}`."""
    if size is not None and (size.max_height is None or size.max_height != size.max_width):
        raise ConfigError(
            f"size must be {{'max_height': n, 'max_width': n}} with the same n (patches per side), got {dict(size)}."
        )


class MoonViTImageProcessor(TorchvisionBackend):
    """Native-resolution image processor of MoonViT-3D (same settings and outputs as `Kimi_K25ImageProcessor`).

    Accepts one image or a list (nested lists allowed) of paths, `file://` URLs, PIL images, uint8 numpy arrays
    (`[H, W]`, `[H, W, C]`, `[C, H, W]`, or `[N, ...]` for N images; all read through `media.load_image`) or
    already-decoded torch tensors and float numpy arrays (uint8, or floats in 0..255; floats in [0, 1] need
    `do_rescale=False`; channels as transformers infers them). Settings may be overridden per call.
    """

    do_resize = True
    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}
    max_patches = 16384
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = 14
    merge_size = 2
    valid_kwargs = MoonViTImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def fetch_images(self, image_url_or_urls: Any) -> Any:
        """Read every non-tensor entry with `media.load_image` (RGB PIL image), except float numpy arrays, which are
        read as the same float tensor (as transformers reads them); lists keep their nesting and a 4-D numpy array
        `[N, ...]` is a list of N images (as a 4-D tensor is)."""
        if isinstance(image_url_or_urls, (list, tuple)) or (
                isinstance(image_url_or_urls, np.ndarray) and image_url_or_urls.ndim == 4):
            return [self.fetch_images(x) for x in image_url_or_urls]
        if isinstance(image_url_or_urls, torch.Tensor):
            return image_url_or_urls
        if isinstance(image_url_or_urls, np.ndarray) and np.issubdtype(image_url_or_urls.dtype, np.floating):
            return torch.from_numpy(np.ascontiguousarray(image_url_or_urls))  # read as the same float tensor
        return load_image(image_url_or_urls)

    def _validate_preprocess_kwargs(self, size: SizeDict | None = None, **kwargs: Any) -> None:
        check_square_size(size)
        super()._validate_preprocess_kwargs(size=size, **kwargs)

    def _preprocess(
        self,
        images: list[torch.Tensor],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling | int | None,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: float | tuple[float, ...] | None,
        image_std: float | tuple[float, ...] | None,
        patch_size: int,
        merge_size: int,
        max_patches: int,
        return_tensors: str | TensorType | None,
        **kwargs: Any,
    ) -> BatchFeature:
        """`images`: list of uint8 `[3, H, W]` tensors -> `pixel_values`, `image_grid_thw` (module docstring)."""
        patches, grids = [], []
        for image in images:
            check_not_rescaled(image, do_rescale, "image")
            image = resize_and_pad(self, image, do_resize, size, resample, patch_size, merge_size, max_patches)
            image = self.rescale_and_normalize(image, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            patches.append(patchify(image, patch_size))
            grids.append([1, image.shape[-2] // patch_size, image.shape[-1] // patch_size])
        return BatchFeature(
            data={"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids, dtype=torch.long)},
            tensor_type=return_tensors,
        )

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Patches (before merging) of an image of `height x width` pixels; `images_kwargs` overrides settings."""
        grid_h, grid_w = patch_grid(self, height, width, images_kwargs)
        return grid_h * grid_w

    def get_num_image_tokens(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Placeholder (merged) tokens of an image of `height x width` pixels: `grid_h * grid_w / merge**2`."""
        merge = (images_kwargs or {}).get("merge_size", self.merge_size)
        return self.get_number_of_image_patches(height, width, images_kwargs) // merge**2


__all__ = [
    "MoonViTImageProcessor",
    "MoonViTImageProcessorKwargs",
    "check_not_rescaled",
    "fit_to_patch_budget",
    "patch_grid",
    "patchify",
    "resize_and_pad",
]
