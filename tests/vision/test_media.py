"""Safe media I/O: image modes, EXIF, refusal of bad or oversized files, video sampling with decord.

Fixtures are generated here: images with Pillow, mp4 videos with PyAV (`av`).
"""

import re
import struct
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from kimi_vl.errors import ConfigError, InvalidMediaError, KimiVLError
from kimi_vl.vision.media import DEFAULT_MAX_PIXELS, load_image, load_video, sample_frame_indices, to_rgb

av = pytest.importorskip("av")


# --- fixture builders ------------------------------------------------------------------------------------------------
def _noise(h: int, w: int, c: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width x height` RGB but whose pixel data is a few bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + _png_chunk(b"IEND", b"")
    )


def write_video(path: Path, frames: np.ndarray, fps: int = 10) -> Path:
    """Encode uint8 frames `[T, H, W, 3]` (H, W even) as an mpeg4 mp4."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


VFR_PTS_MS = [0, 125, 250, 375, 500, 625, 3000, 3125, 3250, 3375, 6000, 7000]
"""Frame start times (ms) of `write_vfr_video`'s default clip: bursts at 8 fps with static gaps, as a screen recorder
writes (times in 1/8 s, exact in decord's float32). Its container states 24 fps; decord ends the last frame 1/24 s
after its start, so the clip lasts 7.041 s."""


def write_vfr_video(path: Path, pts_ms: list[int] = VFR_PTS_MS) -> Path:
    """A variable-frame-rate Matroska video (mpeg4, time base 1 ms, 32x32) whose frame i starts at `pts_ms[i]` and is
    a flat grey of level 10 + 20 * i."""
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("mpeg4")
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        for i, pts in enumerate(pts_ms):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 10 + 20 * i, np.uint8), format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def flat_frames(n: int, h: int = 32, w: int = 48) -> np.ndarray:
    """Frame i is a flat grey of level 10 + 20 * i (identifiable after lossy coding)."""
    return np.stack([np.full((h, w, 3), 10 + 20 * i, np.uint8) for i in range(n)])


@pytest.fixture
def video8(tmp_path: Path) -> Path:
    return write_video(tmp_path / "clip.mp4", flat_frames(8), fps=10)


# --- images: sources --------------------------------------------------------------------------------------------------
def test_path_pathlike_url_pil_and_array_agree(tmp_path):
    pixels = _noise(9, 11)
    path = tmp_path / "a b.png"  # a space: the file URL is percent-encoded
    Image.fromarray(pixels).save(path)
    for src in (str(path), path, path.as_uri(), Image.open(path), pixels):
        image = load_image(src)
        assert image.mode == "RGB" and image.size == (11, 9)
        np.testing.assert_array_equal(np.asarray(image), pixels)


def test_numpy_greyscale_and_rgba_arrays():
    grey = _noise(5, 7, 1)
    for arr in (grey, grey[:, :, 0]):
        np.testing.assert_array_equal(np.asarray(load_image(arr)), np.repeat(grey, 3, axis=2))
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # one opaque red pixel, the rest fully transparent -> white
    out = np.asarray(load_image(rgba))
    assert out[0, 0].tolist() == [200, 0, 0] and out[1, 1].tolist() == [255, 255, 255]


def test_channels_first_arrays_equal_channels_last():
    rgba = _noise(5, 7, 4)
    for hwc in (rgba[:, :, :1], rgba[:, :, :3], rgba):
        np.testing.assert_array_equal(np.asarray(load_image(hwc.transpose(2, 0, 1))), np.asarray(load_image(hwc)))


@pytest.mark.parametrize(
    "array, problem",
    [
        (np.zeros((4, 4, 3), np.float32), "dtype float32"),
        (np.zeros((5, 4, 2), np.uint8), "shape (5, 4, 2)"),
        (np.zeros((2, 4, 4, 3), np.uint8), "shape (2, 4, 4, 3)"),
        (np.zeros((0, 5, 3), np.uint8), "zero size"),
    ],
)
def test_bad_arrays_are_refused(array, problem):
    with pytest.raises(InvalidMediaError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        load_image(array)


def test_unsupported_source_type():
    with pytest.raises(InvalidMediaError, match="cannot read an image from a int"):
        load_image(3)  # type: ignore[arg-type]


# --- images: EXIF and modes -------------------------------------------------------------------------------------------
def test_exif_orientation_is_applied(tmp_path):
    # Stored 40 wide x 20 high: left half red, right half blue. Orientation 6 = "rotate 90 degrees clockwise to
    # display", so the displayed image is 20 wide x 40 high with red on top.
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = (255, 0, 0)
    pixels[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    Image.fromarray(pixels).save(path, exif=exif.tobytes(), quality=95)
    assert Image.open(path).size == (40, 20)  # what a reader that ignores EXIF sees

    image = load_image(path)
    assert image.size == (20, 40)
    out = np.asarray(image).astype(int)
    assert (np.abs(out[5, 10] - (255, 0, 0)) < 30).all()  # top: red
    assert (np.abs(out[35, 10] - (0, 0, 255)) < 30).all()  # bottom: blue


def test_alpha_modes_composite_over_white():
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (100, 50, 0, 0))  # fully transparent -> white
    rgba.putpixel((1, 0), (100, 50, 0, 128))  # half -> halfway to white
    out = np.asarray(to_rgb(rgba)).astype(int)
    assert out[0, 0].tolist() == [255, 255, 255]
    assert np.abs(out[0, 1] - np.array([100, 50, 0]) * 128 / 255 - 255 * 127 / 255).max() <= 1

    la = Image.new("LA", (1, 1), (40, 0))
    assert np.asarray(to_rgb(la)).tolist() == [[[255, 255, 255]]]


def test_premultiplied_alpha_modes_composite_like_straight_alpha():
    la = Image.new("LA", (2, 1), (90, 255))
    la.putpixel((1, 0), (90, 0))
    rgba = la.convert("RGBA")
    for straight, premultiplied in ((la, la.convert("La")), (rgba, rgba.convert("RGBa"))):
        assert np.asarray(to_rgb(premultiplied)).tolist() == np.asarray(to_rgb(straight)).tolist()


def test_palette_with_transparency_and_rgba_palette():
    pal = Image.new("P", (2, 1))
    pal.putpalette([10, 20, 30, 200, 100, 0] + [0] * 762)
    pal.putpixel((0, 0), 0)
    pal.putpixel((1, 0), 1)
    assert np.asarray(to_rgb(pal)).tolist() == [[[10, 20, 30], [200, 100, 0]]]
    pal.info["transparency"] = 1
    assert np.asarray(to_rgb(pal)).tolist() == [[[10, 20, 30], [255, 255, 255]]]


def test_wide_greyscale_is_scaled_not_clipped():
    values = np.array([[0, 257, 32768, 65535]], np.uint16)
    image16 = Image.fromarray(values)
    assert image16.mode == "I;16"
    expected = [0, 1, 128, 255]
    assert np.asarray(to_rgb(image16))[0, :, 0].tolist() == expected
    image32 = Image.fromarray(values.astype(np.int32))
    assert image32.mode == "I"
    assert np.asarray(to_rgb(image32))[0, :, 0].tolist() == expected


def test_cmyk_bilevel_and_greyscale_files_load_as_rgb(tmp_path):
    rgb = Image.fromarray(_noise(6, 8))
    cases = {
        "cmyk.jpg": rgb.convert("CMYK"),
        "grey.png": rgb.convert("L"),
        "bilevel.png": rgb.convert("1"),
        "wide.png": Image.fromarray(_noise(6, 8, 1)[..., 0].astype(np.uint16) * 257),
        "la.png": rgb.convert("LA"),
    }
    for name, image in cases.items():
        image.save(tmp_path / name)
        out = load_image(tmp_path / name)
        assert out.mode == "RGB" and out.size == (8, 6), name
    cmyk = load_image(tmp_path / "cmyk.jpg")
    np.testing.assert_array_equal(np.asarray(cmyk), np.asarray(Image.open(tmp_path / "cmyk.jpg").convert("RGB")))


# --- images: refusals -------------------------------------------------------------------------------------------------
def test_missing_directory_empty_and_remote_sources(tmp_path):
    with pytest.raises(InvalidMediaError, match=r"nope\.png.*does not exist"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(InvalidMediaError, match="is a directory"):
        load_image(tmp_path)
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(InvalidMediaError, match=r"empty\.png.*empty \(0 bytes\)"):
        load_image(tmp_path / "empty.png")
    with pytest.raises(InvalidMediaError, match="no network access"):
        load_image("https://example.com/cat.png")
    with pytest.raises(InvalidMediaError, match="must point to this machine"):
        load_image("file://otherhost/cat.png")


def test_a_name_too_long_for_the_filesystem_is_refused_as_media():
    for load in (load_image, load_video):
        with pytest.raises(InvalidMediaError, match="not a usable path"):
            load("A" * 5000)  # e.g. a bare base64 payload: ENAMETOOLONG, not a plain OSError


def test_truncated_image_names_file(tmp_path):
    path = tmp_path / "truncated.png"
    Image.fromarray(_noise(64, 64)).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidMediaError, match=r"truncated\.png.*corrupt or truncated") as info:
        load_image(path)
    assert isinstance(info.value, KimiVLError)


def test_an_error_on_a_deep_path_keeps_the_file_name(tmp_path):
    """A path longer than the message's limit keeps its start and its file name (a cluster's dataset folders are
    deep; a message that kept only the start named no file)."""
    deep = tmp_path.joinpath(*["a_long_dataset_folder"] * 6)
    deep.mkdir(parents=True)
    bad = deep / "frame_000123.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(InvalidMediaError) as info:
        load_image(bad)
    message = str(info.value)
    assert message.startswith(f"image '{str(bad)[:18]}...")
    assert re.search(r"a_long_dataset_folder/frame_000123\.png \([\d,]+ characters\)' cannot be read", message), message


def test_corrupt_images_name_file(tmp_path):
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    with pytest.raises(InvalidMediaError, match=r"garbage\.jpg.*cannot be read as an image"):
        load_image(garbage)

    damaged = tmp_path / "damaged.png"  # valid header, broken compressed data
    Image.fromarray(_noise(32, 32)).save(damaged)
    data = bytearray(damaged.read_bytes())
    data[60:90] = b"\xff" * 30
    damaged.write_bytes(bytes(data))
    with pytest.raises(InvalidMediaError, match=r"damaged\.png.*corrupt or truncated"):
        load_image(damaged)


def test_zero_size_images(tmp_path):
    with pytest.raises(InvalidMediaError, match=r"zero size \(0x5\)"):
        load_image(Image.new("RGB", (0, 5)))
    path = tmp_path / "zero.png"  # a PNG header declaring width 0 is not a readable image
    path.write_bytes(_png_header_only(0, 10))
    with pytest.raises(InvalidMediaError, match=r"zero\.png.*cannot be read"):
        load_image(path)


def test_pixel_limit_refuses_before_decoding(tmp_path, monkeypatch):
    def no_decoding(self):
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    monkeypatch.setattr(Image.Image, "load", no_decoding)

    huge = tmp_path / "huge.png"  # 12000 x 12000 claimed, ~100 bytes on disk
    huge.write_bytes(_png_header_only(12000, 12000))
    assert 12000 * 12000 > DEFAULT_MAX_PIXELS
    with pytest.raises(InvalidMediaError, match=r"huge\.png.*12000x12000.*over the limit.*before decoding"):
        load_image(huge)

    bomb = tmp_path / "bomb.png"  # beyond Pillow's own hard limit: refused while reading the header
    bomb.write_bytes(_png_header_only(30000, 30000))
    with pytest.raises(InvalidMediaError, match=r"bomb\.png.*decompression-bomb"):
        load_image(bomb)

    monkeypatch.undo()
    small = tmp_path / "small.png"
    Image.fromarray(_noise(20, 20)).save(small)
    with pytest.raises(InvalidMediaError, match="400 pixels, over the limit of 399"):
        load_image(small, max_pixels=399)
    assert load_image(small, max_pixels=400).size == (20, 20)


# --- videos -----------------------------------------------------------------------------------------------------------
def test_sample_frame_indices_rules():
    assert sample_frame_indices(10, source_fps=10, num_frames=4).tolist() == [0, 2, 5, 7]
    assert sample_frame_indices(10, source_fps=10, fps=2).tolist() == [0, 5]
    assert sample_frame_indices(10, source_fps=10, fps=100).tolist() == list(range(10))  # no duplicates
    assert sample_frame_indices(10, source_fps=10).tolist() == list(range(10))
    assert sample_frame_indices(10, source_fps=10, fps=0.01).tolist() == [0]  # at least one frame
    assert sample_frame_indices(10, source_fps=10, max_frames=3).tolist() == [0, 3, 6]
    assert sample_frame_indices(10, source_fps=None, num_frames=2, fps=5).tolist() == [0, 5]  # count wins
    with pytest.raises(InvalidMediaError, match="11 frames requested but the video has only 10"):
        sample_frame_indices(10, source_fps=10, num_frames=11)
    with pytest.raises(InvalidMediaError, match="source frame rate"):
        sample_frame_indices(10, source_fps=None, fps=2)
    with pytest.raises(ConfigError):
        sample_frame_indices(10, source_fps=10, num_frames=5, max_frames=4)
    for fps in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="fps must be a positive, finite rate"):
            sample_frame_indices(10, source_fps=10, fps=fps)


def test_load_video_all_frames_and_timestamps(video8):
    clip = load_video(video8)
    assert clip.frames.shape == (8, 32, 48, 3) and clip.frames.dtype == np.uint8
    assert clip.fps == pytest.approx(10.0) and clip.total_frames == 8
    np.testing.assert_allclose(clip.timestamps, np.arange(8) / 10, atol=1e-3)
    levels = clip.frames.reshape(8, -1).mean(1)
    np.testing.assert_allclose(levels, 10 + 20 * np.arange(8), atol=4)  # the right frames, in order


def test_load_video_by_count_and_fps(video8):
    by_count = load_video(video8.as_uri(), num_frames=3)
    assert by_count.indices.tolist() == [0, 2, 5]
    np.testing.assert_allclose(by_count.timestamps, [0.0, 0.2, 0.5], atol=1e-3)
    np.testing.assert_allclose(by_count.frames.reshape(3, -1).mean(1), [10, 50, 110], atol=4)

    by_fps = load_video(video8, fps=5)  # 0.8 s at 5 fps -> 4 frames
    assert by_fps.indices.tolist() == [0, 2, 4, 6]
    capped = load_video(video8, max_frames=2)
    assert capped.indices.tolist() == [0, 4]


def test_padded_row_widths_decode_correctly(tmp_path):
    # decord 0.6 mis-sizes frames whose RGB rows are padded by FFmpeg (width 48 here); load_video repairs them.
    frames = np.zeros((3, 32, 48, 3), np.uint8)
    frames[:, :, :24] = (200, 30, 30)
    frames[:, :, 24:] = (30, 30, 200)
    clip = load_video(write_video(tmp_path / "w48.mp4", frames), num_frames=2)
    assert clip.frames.shape == (2, 32, 48, 3)
    assert np.abs(clip.frames.astype(int) - frames[:2]).max() < 12


def test_gif_animation_is_read_with_its_frame_delays(tmp_path):
    """Screen recorders (Peek, LICEcap, Kap) write GIFs, which decord cannot open: they are read with Pillow, each
    frame shown for its delay (0 ms: 100 ms, as browsers play it), transparent pixels on white."""
    levels = [10, 60, 110, 160, 210, 250]
    frames = [Image.fromarray(np.full((30, 40, 3), v, np.uint8)) for v in levels]
    gif = tmp_path / "screen recording é.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=[100, 100, 0, 200, 100, 100], loop=0)
    clip = load_video(gif)
    assert clip.frames.shape == (6, 30, 40, 3) and clip.frames.dtype == np.uint8 and clip.total_frames == 6
    assert clip.frames[:, 0, 0, 0].tolist() == levels
    np.testing.assert_allclose(clip.timestamps, [0.0, 0.1, 0.2, 0.3, 0.5, 0.6])
    assert clip.fps == pytest.approx(6 / 0.7)
    by_count = load_video(gif.as_uri(), num_frames=3)
    assert by_count.indices.tolist() == [0, 2, 4] and by_count.frames[:, 0, 0, 0].tolist() == [10, 110, 210]
    assert load_video(gif, fps=2).indices.tolist() == [0]  # 0.7 s at 2 fps
    with pytest.raises(InvalidMediaError, match="7 frames requested but the video has only 6"):
        load_video(gif, num_frames=7)
    (tmp_path / "cut.gif").write_bytes(gif.read_bytes()[:60])
    with pytest.raises(InvalidMediaError, match=r"cut\.gif.*corrupt or truncated GIF"):
        load_video(tmp_path / "cut.gif")
    transparent = Image.new("P", (8, 8), 0)
    transparent.save(tmp_path / "t.gif", transparency=0)
    assert load_video(tmp_path / "t.gif").frames.reshape(-1, 3).min() == 255


def test_variable_frame_rate_video_is_sampled_by_presentation_time(tmp_path, video8):
    """Screen recorders write variable-frame-rate files: frames are spaced uniformly in time over the true duration
    (not `frame count / average fps`), each sample the frame showing then, timed by when it was sampled (every frame
    kept: by its own start)."""
    path = write_vfr_video(tmp_path / "screen.mkv")
    every = load_video(path)
    assert every.variable_rate and every.indices.tolist() == list(range(12))  # every frame once
    np.testing.assert_allclose(every.timestamps, np.array(VFR_PTS_MS) / 1000)
    assert every.duration == pytest.approx(7.041, abs=1e-3) and every.fps == 24.0

    # 1 fps over 7.041 s: 7 samples at 0, 1.006, ..., 6.035 s; the frame starting at 0.625 s shows until 3 s
    by_fps = load_video(path, fps=1)
    assert by_fps.indices.tolist() == [0, 5, 5, 6, 9, 9, 10]
    np.testing.assert_allclose(by_fps.timestamps, np.arange(7) * every.duration / 7)
    np.testing.assert_allclose(by_fps.frames[:, 0, 0, 0], 10 + 20 * by_fps.indices, atol=4)  # the frames themselves
    assert load_video(path, fps=2).indices.tolist() == [0, 4, 5, 5, 5, 5, 9, 9, 9, 9, 9, 10]  # 12 samples (cap)
    assert load_video(path, num_frames=4).indices.tolist() == [0, 5, 9, 9]  # at 0, 1.76, 3.52, 5.28 s
    assert load_video(path, max_frames=3).indices.tolist() == [0, 5, 9]  # at 0, 2.35, 4.69 s
    constant = load_video(video8)
    assert not constant.variable_rate and constant.duration == 0.8


def test_variable_delay_gif_is_sampled_by_presentation_time(tmp_path):
    levels = [10, 60, 110, 160, 210, 250]
    frames = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in levels]
    gif = tmp_path / "recording.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=[100, 100, 100, 2000, 100, 1000], loop=0)
    clip = load_video(gif, fps=2)  # 3.4 s: 6 samples at 0, 0.567, ..., 2.833 s; frame 3 shows from 0.3 to 2.3 s
    assert clip.variable_rate and clip.duration == pytest.approx(3.4)
    assert clip.indices.tolist() == [0, 3, 3, 3, 3, 5] and clip.frames[:, 0, 0, 0].tolist() == [10, 160, 160, 160,
                                                                                               160, 250]
    np.testing.assert_allclose(clip.timestamps, np.arange(6) * 3.4 / 6)
    assert load_video(gif, num_frames=3).indices.tolist() == [0, 3, 3]
    assert load_video(gif).indices.tolist() == list(range(6))


@pytest.mark.parametrize(
    "settings, indices, stamps",
    [
        ({}, list(range(25)), None),
        ({"fps": 2}, [0, 6, 12, 18], [0.0, 0.47999998927116394, 0.9599999785423279, 1.440000057220459]),
        ({"fps": 3}, [0, 4, 8, 12, 16, 20], [0.0, 0.3199999928474426, 0.6399999856948853, 0.9599999785423279,
                                              1.2799999713897705, 1.600000023841858]),
        ({"fps": 7.5}, [0, 1, 3, 5, 6, 8, 10, 11, 13, 15, 16, 18, 20, 21, 23], None),
        ({"num_frames": 5}, [0, 5, 10, 15, 20], [0.0, 0.4000000059604645, 0.800000011920929, 1.2000000476837158,
                                                 1.600000023841858]),
        ({"max_frames": 4}, [0, 6, 12, 18], [0.0, 0.47999998927116394, 0.9599999785423279, 1.440000057220459]),
    ],
)
def test_constant_rate_sampling_is_pinned(tmp_path, settings, indices, stamps):
    """Constant-rate files keep the index rule `floor(i * total / n)` and decord's own (float32) start times, exactly
    as before variable-rate sampling existed (12.5 fps: starts just below whole milliseconds)."""
    frames = np.zeros((25, 32, 48, 3), np.uint8)
    clip = load_video(write_video(tmp_path / "c.mp4", frames, fps=Fraction(25, 2)), **settings)
    assert clip.fps == 12.5 and clip.indices.tolist() == indices
    assert clip.timestamps.tolist() == (stamps or np.float32(np.array(indices) * 0.08).astype(np.float64).tolist())


@pytest.mark.parametrize(
    "settings, indices",
    [({}, list(range(9))), ({"fps": 2}, [0]), ({"fps": 3}, [0, 4]), ({"fps": 7.5}, [0, 1, 3, 5, 7]),
     ({"num_frames": 5}, [0, 1, 3, 5, 7]), ({"max_frames": 4}, [0, 2, 4, 6])],
)
def test_constant_rate_gif_sampling_is_pinned(tmp_path, settings, indices):
    frames = [Image.fromarray(np.full((8, 8, 3), 20 * i, np.uint8)) for i in range(9)]
    frames[0].save(tmp_path / "g.gif", save_all=True, append_images=frames[1:], duration=80, loop=0)
    clip = load_video(tmp_path / "g.gif", **settings)
    assert clip.indices.tolist() == indices
    assert clip.timestamps.tolist() == [[0.0, 0.08, 0.16, 0.24, 0.32, 0.4, 0.48, 0.56, 0.64][i] for i in indices]


def test_more_frames_than_exist_is_an_error(video8):
    with pytest.raises(InvalidMediaError, match=r"clip\.mp4.*9 frames requested but the video has only 8"):
        load_video(video8, num_frames=9)


def test_missing_corrupt_truncated_and_frameless_videos(tmp_path, video8):
    with pytest.raises(InvalidMediaError, match=r"missing\.mp4.*does not exist"):
        load_video(tmp_path / "missing.mp4")

    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 100)
    with pytest.raises(InvalidMediaError, match=r"corrupt\.mp4.*cannot be decoded"):
        load_video(corrupt)

    truncated = tmp_path / "truncated.mp4"  # the index (moov atom) is at the end: cut off
    data = video8.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidMediaError, match=r"truncated\.mp4.*(cannot be decoded|no decodable video frames)"):
        load_video(truncated)

    empty = tmp_path / "no_frames.mp4"  # a video track with zero encoded frames
    with av.open(str(empty), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        container.start_encoding()
    with pytest.raises(InvalidMediaError, match=r"no_frames\.mp4.*no decodable video frames"):
        load_video(empty)


def test_reader_reporting_zero_frames(monkeypatch, video8):
    import decord

    class EmptyReader:
        def __init__(self, *args, **kwargs):
            pass

        def __len__(self):
            return 0

        def get_avg_fps(self):
            return 25.0

    monkeypatch.setattr(decord, "VideoReader", EmptyReader)
    with pytest.raises(InvalidMediaError, match=r"clip\.mp4.*contains no frames"):
        load_video(video8)
