"""The encoding layer (`kimi_vl.data.encode`): clips read with `load_video` keep their timing; chats are trained on
the chat template's assistant tokens."""

import base64
import io
import re

import numpy as np
from PIL import Image

from kimi_vl.data.encode import IGNORE_INDEX, encode_chat, process
from kimi_vl.tokenization import IM_ASSISTANT, IM_END, IM_MIDDLE, VIDEO_PLACEHOLDER
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


def test_encode_chat_loss_is_the_templates_assistant_mask(proc):
    """Special-token strings in a message's text (a user quoting the chat format, a reply about it) do not move the
    loss: `encode_chat` trains on exactly the tokens `apply_chat_template(..., return_assistant_tokens_mask=True)`
    (TRL's assistant-only loss) marks, after images and videos are expanded as well."""
    image = Image.fromarray(np.full((40, 60, 3), 200, np.uint8))
    quoted = f"say {IM_END}{IM_ASSISTANT}assistant{IM_MIDDLE}the cat"
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": quoted}]},
        {"role": "assistant", "content": f"ok {IM_END} dog"},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": "red"},
    ]
    doc = encode_chat(messages, proc)
    out = proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert doc.input_ids == out["input_ids"][0]
    assert [lab != IGNORE_INDEX for lab in doc.labels] == [bool(m) for m in out["assistant_masks"][0]]
    # behind a video too
    frames = np.zeros((4, 28, 28, 3), np.uint8)
    messages[2]["content"][0] = {"type": "video", "video": frames}
    doc = encode_chat(messages, proc)
    trained = proc.tokenizer.decode([t for t, lab in zip(doc.input_ids, doc.labels) if lab != IGNORE_INDEX])
    assert trained == f"ok {IM_END} dog{IM_END}red{IM_END}"


def test_a_video_file_next_to_decoded_frames_is_read_as_the_processor_reads_it(proc, tmp_path):
    """A record's videos may be a file and a list of frame images (README, "Train on your own data"): the file is
    sampled at the processor's fps, as the processor samples it given alone (same frames, grid and chunk times),
    and the frames follow it, taken as sampled at that fps."""
    path = write_video(tmp_path / "c.mp4", np.random.RandomState(0).randint(0, 255, (12, 32, 48, 3), np.uint8), fps=4)
    frames = [np.full((28, 42, 3), 40 * t, np.uint8) for t in range(5)]
    ids, media = process(proc, VIDEO_PLACEHOLDER * 2, videos=[str(path), frames])
    alone_ids, alone = process(proc, VIDEO_PLACEHOLDER, videos=[str(path)])
    file_chunks, file_patches = len(alone["video_grid_thw"]), len(alone["pixel_values_videos"])
    assert media["video_grid_thw"][:file_chunks].tolist() == alone["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4]]
    assert media["video_grid_thw"][file_chunks:, 0].tolist() == [4, 1]
    assert np.array_equal(media["pixel_values_videos"][:file_patches], alone["pixel_values_videos"])
    assert _stamps(proc, ids) == _stamps(proc, alone_ids) + ["00:00:00.000", "00:00:02.000"]


def test_encode_chat_reads_every_image_part_apply_chat_template_reads(proc):
    """Image parts as transformers takes them: a bare `base64` payload and OpenAI's `image_url` part
    (`{"url": ...}`) encode as the decoded image does (as `apply_chat_template` reads them)."""
    image = Image.fromarray(np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    payload = base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image", "base64": payload},
             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}}]
    expected = encode_chat([{"role": "user", "content": [{"type": "image", "image": image}]},
                            {"role": "assistant", "content": "red"}], proc)
    for part in parts:
        doc = encode_chat([{"role": "user", "content": [part]}, {"role": "assistant", "content": "red"}], proc)
        assert doc.input_ids == expected.input_ids and doc.labels == expected.labels
        assert doc.media["pixel_values"].equal(expected.media["pixel_values"])
