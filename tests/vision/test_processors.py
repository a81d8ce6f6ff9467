"""MoonViT image / video processors: parity with transformers' kimi_k25 processors, token counts, properties."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.kimi_k25 import Kimi_K25ImageProcessor, Kimi_K25VideoProcessor
from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

from kimi_vl.errors import ConfigError, InvalidMediaError
from kimi_vl.vision.image_processing import MoonViTImageProcessor, fit_to_patch_budget
from kimi_vl.vision.media import load_video
from kimi_vl.vision.video_processing import MoonViTVideoProcessor

from .test_media import flat_frames, write_video

KIMI_SETTINGS = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _noise(h: int, w: int, c: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)


def assert_same(ours, ref, keys):
    for key in keys:
        a, b = ours[key], ref[key]
        assert a.shape == b.shape, key
        assert a.dtype == b.dtype, key
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def image_pair():
    return MoonViTImageProcessor(), Kimi_K25ImageProcessor()


@pytest.fixture(scope="module")
def video_pair():
    return MoonViTVideoProcessor(), Kimi_K25VideoProcessor()


# --- image parity ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width, height", [(13, 7), (1000, 333), (3000, 2000), (7, 400)])
def test_image_parity_sizes(image_pair, width, height):
    ours, ref = image_pair
    image = Image.fromarray(_noise(height, width))
    out, expected = ours(image, return_tensors="pt"), ref(image, return_tensors="pt")
    assert_same(out, expected, ["pixel_values", "image_grid_thw"])
    grid = out["image_grid_thw"][0]
    assert ours.get_num_image_tokens(height, width) == int(grid.prod()) // 4
    assert ours.get_number_of_image_patches(height, width) == ref.get_number_of_image_patches(height, width)


def test_budget_cap_engages(image_pair):
    ours, _ = image_pair
    grid = ours(Image.fromarray(_noise(2000, 3000)), return_tensors="pt")["image_grid_thw"][0].tolist()
    assert grid[1] * grid[2] < (2000 // 14) * (3000 // 14)  # downscaled
    assert grid[1] * grid[2] <= 16384 + 2 * (grid[1] + grid[2])  # budget, up to the padding border


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA"])
def test_image_parity_modes(image_pair, mode):
    ours, ref = image_pair
    rgba = Image.fromarray(_noise(50, 61, 4))
    image = rgba.convert("RGB").quantize(32) if mode == "P" else rgba.convert(mode)
    assert_same(ours(image, return_tensors="pt"), ref(image, return_tensors="pt"), ["pixel_values", "image_grid_thw"])


def test_image_parity_batch_settings_and_paths(image_pair, tmp_path):
    ours, ref = image_pair
    images = [Image.fromarray(_noise(h, w, seed=h)) for h, w in [(30, 90), (100, 40), (30, 90), (300, 301)]]
    kwargs = {**KIMI_SETTINGS, "max_patches": 64, "size": {"max_height": 12, "max_width": 12}}
    assert_same(ours(images, **kwargs), ref(images, **kwargs), ["pixel_values", "image_grid_thw"])

    paths = []
    for i, image in enumerate(images):
        paths.append(tmp_path / f"{i}.png")
        image.save(paths[-1])
    assert_same(ours(paths, **kwargs), ref(images, **kwargs), ["pixel_values", "image_grid_thw"])

    configured = MoonViTImageProcessor(**kwargs)
    assert_same(configured(images), ref(images, **kwargs), ["pixel_values", "image_grid_thw"])


def test_numpy_layouts_equal_a_list_of_channels_last_arrays(image_pair):
    ours, _ = image_pair
    batch = np.stack([_noise(30, 45, seed=0), _noise(30, 45, seed=1)])
    expected = ours(list(batch), return_tensors="pt")
    for images in (batch, batch.transpose(0, 3, 1, 2), list(batch.transpose(0, 3, 1, 2))):
        assert_same(ours(images, return_tensors="pt"), expected, ["pixel_values", "image_grid_thw"])


def test_float_numpy_arrays_are_read_as_float_tensors(image_pair):
    """Float numpy arrays (0..255, or [0, 1] with `do_rescale=False`) are processed as transformers processes them,
    like the equivalent float tensor, not refused."""
    ours, ref = image_pair
    batch = np.stack([_noise(30, 45, seed=0), _noise(30, 45, seed=1)]).astype(np.float32)
    for images, kwargs in ((batch, {}), (list(batch.astype(np.float64) / 255), {"do_rescale": False})):
        out = ours(images, return_tensors="pt", **kwargs)
        assert_same(out, ref(images, return_tensors="pt", **kwargs), ["pixel_values", "image_grid_thw"])
        assert_same(out, ours(torch.from_numpy(np.stack(images)), return_tensors="pt", **kwargs), ["pixel_values"])


def test_padding_is_black_and_normalised_to_minus_one():
    processor = MoonViTImageProcessor(**KIMI_SETTINGS)
    out = processor(Image.new("RGB", (15, 15), (255, 255, 255)), return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 2, 2]]
    # patch 0 holds image pixels 0..13 (white -> 1.0); patch 3 (bottom right) holds only pixel (14, 14).
    assert (out["pixel_values"][0] == 1.0).all()
    last = out["pixel_values"][3]
    assert (last[:, 0, 0] == 1.0).all() and (last[:, 1:, :] == -1.0).all() and (last[:, :, 1:] == -1.0).all()


def test_no_resize_still_pads():
    processor = MoonViTImageProcessor()
    out = processor(Image.new("RGB", (3000, 30)), do_resize=False, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 216]]


def test_token_counts_follow_do_resize_off():
    """`do_resize=False` (a setting or a per-call override) keeps the image size: the predicted patch and placeholder
    counts are those of the padded, unresized image, as the outputs are."""
    image, video = _noise(300, 200), np.stack([_noise(300, 200, seed=i) for i in range(4)])
    for kwargs, setting in (({"do_resize": False}, {}), ({}, {"do_resize": False})):
        images = MoonViTImageProcessor(max_patches=64, **setting)
        grid = images(image, return_tensors="pt", **kwargs)["image_grid_thw"]
        assert grid.tolist() == [[1, 22, 16]]
        assert images.get_number_of_image_patches(300, 200, kwargs) == 22 * 16
        assert images.get_num_image_tokens(300, 200, kwargs) == 22 * 16 // 4
        videos = MoonViTVideoProcessor(max_patches=16, **setting)
        grid = videos(video, do_sample_frames=False, return_tensors="pt", **kwargs)["video_grid_thw"]
        assert grid.tolist() == [[4, 22, 16]]
        assert videos.get_num_video_tokens(4, 300, 200, kwargs) == 22 * 16 // 4


def test_float_pixels_in_0_1_are_refused_unless_do_rescale_is_off():
    """Float tensors in [0, 1] (torchvision's `to_tensor`) would be divided by 255 again, a black image: refused with
    a message; with `do_rescale=False` they give the uint8 image's pixels, and float pixels in 0..255 are read."""
    pixels = torch.rand(3, 30, 50)
    as_uint8 = (pixels * 255).round().to(torch.uint8)
    image, video = MoonViTImageProcessor(), MoonViTVideoProcessor()
    with pytest.raises(InvalidMediaError, match=r"do_rescale=False"):
        image(pixels, return_tensors="pt")
    with pytest.raises(InvalidMediaError, match=r"do_rescale=False"):
        video([pixels[None].repeat(2, 1, 1, 1)], do_sample_frames=False, return_tensors="pt")
    ref = image(as_uint8, return_tensors="pt")["pixel_values"]
    assert (image(as_uint8 / 255, do_rescale=False, return_tensors="pt")["pixel_values"] - ref).abs().max() < 1e-5
    assert (image(as_uint8.float(), return_tensors="pt")["pixel_values"] - ref).abs().max() < 1e-5
    black = image(torch.zeros(3, 30, 50, dtype=torch.uint8), return_tensors="pt")["pixel_values"]
    assert torch.equal(image(torch.zeros(3, 30, 50), return_tensors="pt")["pixel_values"], black)


def test_bad_settings_and_bad_media(tmp_path):
    processor = MoonViTImageProcessor()
    with pytest.raises(ConfigError, match="max_height"):
        processor(Image.new("RGB", (20, 20)), size={"max_height": 10, "max_width": 12})
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(InvalidMediaError, match=r"bad\.png"):
        processor(bad)


# --- image properties --------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    height=st.integers(1, 20000),
    width=st.integers(1, 20000),
    max_patches=st.integers(1, 20000),
    side=st.integers(1, 600),
)
def test_budget_rule_matches_transformers(height, width, max_patches, side):
    ours = fit_to_patch_budget(
        height, width, patch_size=14, merge_size=2, max_patches=max_patches, max_side_patches=side
    )
    assert ours == navit_resize(height, width, 14, 2, max_patches, side)


@settings(max_examples=25, deadline=None)
@given(
    height=st.integers(1, 250),
    aspect=st.floats(0.05, 20.0),
    max_patches=st.integers(4, 600),
    seed=st.integers(0, 2**16),
)
def test_image_properties(image_pair, height, aspect, max_patches, seed):
    ours, ref = image_pair
    width = max(1, min(700, round(height * aspect)))
    image = Image.fromarray(_noise(height, width, seed=seed))
    out = ours(image, max_patches=max_patches, return_tensors="pt")
    grid = out["image_grid_thw"]
    t, h, w = grid[0].tolist()
    assert grid.shape == (1, 3) and t == 1 and h % 2 == 0 and w % 2 == 0
    assert out["pixel_values"].shape == (t * h * w, 3, 14, 14)
    tokens = ours.get_num_image_tokens(height, width, {"max_patches": max_patches})
    assert tokens == t * h * w // (2 * 2) and tokens * 4 == t * h * w
    assert torch.isfinite(out["pixel_values"]).all()
    assert_same(out, ref(image, max_patches=max_patches, return_tensors="pt"), ["pixel_values", "image_grid_thw"])


# --- video parity ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_frames, height, width", [(8, 40, 60), (13, 300, 500)])
def test_video_parity(video_pair, num_frames, height, width):
    ours, ref = video_pair
    video = np.random.default_rng(num_frames).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    out = ours(video, do_sample_frames=False, return_tensors="pt")
    expected = ref(video, do_sample_frames=False, return_tensors="pt")
    assert_same(out, expected, ["pixel_values_videos", "video_grid_thw", "num_chunks_per_video"])
    chunks = math.ceil(num_frames / 4)
    grid = out["video_grid_thw"]
    assert out["num_chunks_per_video"].tolist() == [chunks] and grid.shape == (chunks, 3)
    assert grid[:, 0].tolist() == [min(4, num_frames - 4 * c) for c in range(chunks)]
    assert out["pixel_values_videos"].shape[0] == int(grid.prod(-1).sum())
    # each temporal chunk is pooled to one frame's worth of merged tokens
    tokens = ours.get_num_video_tokens(num_frames, height, width)
    assert tokens == int((grid[:, 1] * grid[:, 2]).sum()) // 4
    patches = ref.get_num_of_video_patches(num_frames, height, width)
    assert ours.get_num_of_video_patches(num_frames, height, width) == patches
    assert tokens == chunks * (patches // num_frames) // 4  # transformers' processor rule


def test_video_parity_batch_and_fps_sampling(video_pair):
    ours, ref = video_pair
    rng = np.random.default_rng(3)
    videos = [rng.integers(0, 256, (n, 30, 44, 3), dtype=np.uint8) for n in (10, 6)]
    metadata = [{"total_num_frames": 10, "fps": 5.0}, {"total_num_frames": 6, "fps": 3.0}]
    kwargs = {**KIMI_SETTINGS, "max_patches": 8, "temporal_patch_size": 2}
    out = ours(videos, video_metadata=metadata, return_tensors="pt", **kwargs)
    expected = ref(videos, video_metadata=metadata, return_tensors="pt", **kwargs)
    assert_same(out, expected, ["pixel_values_videos", "video_grid_thw", "num_chunks_per_video"])
    assert out["num_chunks_per_video"].tolist() == [2, 2]  # 2 fps: 4 frames each (2 s), 2 frames per chunk


def test_video_file_matches_decoded_frames(video_pair, tmp_path):
    ours, ref = video_pair
    path = write_video(tmp_path / "clip.mp4", flat_frames(12, 48, 64), fps=6)
    out = ours(path, num_frames=6, return_metadata=True, return_tensors="pt")
    frames = load_video(path, num_frames=6).frames
    expected = ref(frames, do_sample_frames=False, return_tensors="pt")
    assert_same(out, expected, ["pixel_values_videos", "video_grid_thw"])
    metadata = out["video_metadata"][0]
    assert metadata.frames_indices == [0, 2, 4, 6, 8, 10] and metadata.total_num_frames == 12
    np.testing.assert_allclose(metadata.timestamps, np.arange(0, 12, 2) / 6)

    by_fps = ours([path, path.as_uri()], return_tensors="pt")  # default: 2 fps over 2 s -> 4 frames
    assert by_fps["num_chunks_per_video"].tolist() == [1, 1] and by_fps["video_grid_thw"][:, 0].tolist() == [4, 4]


def test_video_files_mixed_with_frames_and_per_sample_lists(video_pair, tmp_path):
    ours, _ = video_pair
    path = write_video(tmp_path / "clip.mp4", flat_frames(6, 32, 48), fps=6)
    frames = load_video(path).frames
    files = ours([path, path], num_frames=3, return_metadata=True, return_tensors="pt")
    metadata = [None, {"total_num_frames": 6, "fps": 6.0}]  # a file's own entry is not needed
    for videos in ([path, frames], [[path], [frames]], [[path], [str(path)]]):
        out = ours(videos, num_frames=3, video_metadata=metadata, return_metadata=True, return_tensors="pt")
        assert_same(out, files, ["pixel_values_videos", "video_grid_thw", "num_chunks_per_video"])
        assert [list(m.frames_indices) for m in out["video_metadata"]] == [[0, 2, 4], [0, 2, 4]]


def test_video_as_list_of_frame_files(video_pair, tmp_path):
    """A video given as its frames' image files (transformers' nesting `[[[f0, f1, ...]]]`, as chat templates pass
    it) is one video read with Pillow, as transformers' processor reads it, not one video file per frame."""
    ours, ref = video_pair
    frames = np.stack([_noise(30, 45, seed=i) for i in range(5)])
    paths = []
    for i, frame in enumerate(frames):
        paths.append(tmp_path / f"frame{i}.png")
        Image.fromarray(frame).save(paths[-1])
    expected = ref(frames, do_sample_frames=False, return_tensors="pt")
    for videos in ([[[str(p) for p in paths]]], [[paths]]):
        out = ours(videos, do_sample_frames=False, return_tensors="pt")
        assert_same(out, expected, ["pixel_values_videos", "video_grid_thw", "num_chunks_per_video"])


def test_video_errors(video_pair, tmp_path):
    ours, _ = video_pair
    path = write_video(tmp_path / "short.mp4", flat_frames(3, 32, 32), fps=10)
    with pytest.raises(InvalidMediaError, match=r"short\.mp4.*5 frames requested but the video has only 3"):
        ours(path, num_frames=5)
    with pytest.raises(InvalidMediaError, match="source frame rate"):
        ours(np.zeros((4, 28, 28, 3), np.uint8))  # fps sampling (default) needs metadata fps
    with pytest.raises(ConfigError, match="max_height"):
        ours(np.zeros((4, 28, 28, 3), np.uint8), do_sample_frames=False, size={"max_height": 4, "max_width": 5})
    square, wide = Image.new("RGB", (56, 56)), Image.new("RGB", (100, 30))
    for videos, match in (([[]], "video 0 has no frames"), ([np.zeros((0, 28, 28, 3), np.uint8)], "video 0 has no frames"),
                          ([square, wide], r"video 0 mixes frame sizes \(height, width\) \[\(30, 100\), \(56, 56\)\]"),
                          ([[square], [square, wide]], "video 1 mixes frame sizes")):
        with pytest.raises(InvalidMediaError, match=match):
            ours(videos, do_sample_frames=False)
    two = ours([np.zeros((3, 56, 56, 3), np.uint8), np.zeros((2, 30, 100, 3), np.uint8)], do_sample_frames=False)
    assert two["video_grid_thw"].tolist() == [[3, 4, 4], [2, 4, 8]]  # two videos of their own sizes are fine


@settings(max_examples=25, deadline=None)
@given(
    num_frames=st.integers(1, 11),
    height=st.integers(1, 120),
    width=st.integers(1, 120),
    max_patches=st.integers(1, 80),
    temporal=st.integers(1, 5),
)
def test_video_properties(video_pair, num_frames, height, width, max_patches, temporal):
    ours, ref = video_pair
    video = np.random.default_rng(num_frames).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    kwargs = {"max_patches": max_patches, "temporal_patch_size": temporal, "do_sample_frames": False}
    out = ours(video, return_tensors="pt", **kwargs)
    grid = out["video_grid_thw"]
    assert int(grid[:, 0].sum()) == num_frames and (grid[:, 1:] % 2 == 0).all()
    assert out["pixel_values_videos"].shape[0] == int(grid.prod(-1).sum())
    tokens = ours.get_num_video_tokens(num_frames, height, width, kwargs)
    assert tokens == int((grid[:, 1] * grid[:, 2]).sum()) // 4
    assert_same(out, ref(video, return_tensors="pt", **kwargs), ["pixel_values_videos", "video_grid_thw"])
