"""Media inputs of the encoding layer (`kimi_vl.data.encode`): clips read with `load_video` keep their timing."""

import re

import numpy as np

from kimi_vl.data.encode import process
from kimi_vl.tokenization import VIDEO_PLACEHOLDER
from kimi_vl.vision.media import load_video
from tests.vision.test_media import write_vfr_video, write_video

STAMP = re.compile(r"(\d\d:\d\d:\d\d\.\d{3})<\|media_start\|>video")


def _stamps(proc, ids: list[int]) -> list[str]:
    return STAMP.findall(proc.tokenizer.decode(ids))


def test_sampled_clips_are_timed_by_their_source_frames(proc, tmp_path):
    """A `VideoFrames` clip passed as a video is stamped with its frames' times in the source (frames 0, 5, ..., 35 of
    a 10 fps file sampled at 2 fps: chunks start at frames 0 and 20, 0 and 2 s), also for a variable-frame-rate
    recording (by its sample times)."""
    frames = np.zeros((41, 32, 48, 3), np.uint8)
    clip = load_video(write_video(tmp_path / "c.mp4", frames, fps=10), fps=2)
    assert clip.indices.tolist()[::4] == [0, 20]
    ids, media = process(proc, VIDEO_PLACEHOLDER, videos=[clip])
    assert _stamps(proc, ids) == ["00:00:00.000", "00:00:02.000"]
    assert media["video_grid_thw"][:, 0].tolist() == [4, 4]
    ids, _ = process(proc, VIDEO_PLACEHOLDER, videos=[tmp_path / "c.mp4"])  # the file itself: the same prompt
    assert _stamps(proc, ids) == ["00:00:00.000", "00:00:02.000"]

    screen = load_video(write_vfr_video(tmp_path / "screen.mkv"), fps=2)  # frames 0, 4, 5, 5 | 5, 5, 9, 9 | 9, ...
    ids, _ = process(proc, VIDEO_PLACEHOLDER * 2, videos=[screen, frames[:5]])  # with frames of no known rate
    assert _stamps(proc, ids) == ["00:00:00.000", "00:00:02.346", "00:00:04.693", "00:00:00.000", "00:00:02.000"]
