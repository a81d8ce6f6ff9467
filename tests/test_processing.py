"""KimiVLProcessor: placeholder expansion, output keys, mismatch errors, chat template with media, save/load,
post-processing."""

import base64
import random
import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

import kimi_vl
from kimi_vl.errors import ConfigError, InvalidMediaError
from kimi_vl.fusion import format_timestamp
from kimi_vl.processing import KimiVLProcessor
from kimi_vl.tokenization import CHAT_TEMPLATE, IM_END, MEDIA_PAD, VIDEO_PLACEHOLDER, build_tokenizer
from kimi_vl.tokenization.chat_template import IMAGE_PROMPT
from kimi_vl.vision import MoonViTImageProcessor, MoonViTVideoProcessor
from kimi_vl.vision.video_processing import TimedVideoMetadata
from tests.vision import test_media
from tests.vision.test_media import write_vfr_video

WORDS = "the a cat dog sees red blue green square circle how many is what describe video image".split()
MEDIA_KEYS = {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
CHUNK_RE = re.compile(
    r"(\d\d:\d\d:\d\d\.\d{3})<\|media_start\|>video<\|media_content\|>((?:<\|kimi_k25_video_placeholder\|>)+)<\|media_end\|>"
)


def _noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def write_video(path: Path, num_frames: int, fps: int, h: int = 48, w: int = 64) -> Path:
    """A tiny mpeg4 mp4 of `num_frames` flat grey frames."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 10 + 20 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "." for _ in range(300)]
    return build_tokenizer(texts, 400)


@pytest.fixture(scope="module")
def proc(tok):
    return KimiVLProcessor(MoonViTImageProcessor(), tok, MoonViTVideoProcessor())


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    png = root / "pic.png"
    Image.fromarray(_noise(50, 90, seed=1)).save(png)
    video = write_video(root / "clip.mp4", num_frames=10, fps=10)
    return {"png": png, "video": video}


def pad_runs(ids, pad_id: int) -> list[int]:
    """Lengths of the maximal runs of `pad_id` in `ids`, in order."""
    runs, n = [], 0
    for t in list(ids) + [None]:
        if t == pad_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


# --- images ------------------------------------------------------------------------------------------------------------
def test_image_expansion_counts(proc):
    sizes = [(40, 60), (100, 30), (300, 200)]
    images = [Image.fromarray(_noise(h, w, seed=i)) for i, (h, w) in enumerate(sizes)]
    text = "".join(f"{IMAGE_PROMPT}image {i}." for i in range(len(images)))
    out = proc(text=text, images=images, return_tensors="pt")
    assert set(out.keys()) == {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"}
    grids = out["image_grid_thw"]
    expected = [proc.image_processor.get_num_image_tokens(h, w) for h, w in sizes]
    assert expected == [int(g.prod()) // 4 for g in grids]
    assert pad_runs(out["input_ids"][0].tolist(), proc.image_token_id) == expected
    assert int((out["input_ids"] == proc.image_token_id).sum()) == sum(expected)
    assert out["pixel_values"].shape[0] == int(grids.prod(-1).sum())


def test_bare_placeholder_and_batch(proc):
    images = [_noise(30, 30, seed=i) for i in range(3)]
    out = proc(text=[f"{MEDIA_PAD}the cat", f"a{MEDIA_PAD}b{MEDIA_PAD}"], images=images, padding=True, return_tensors="pt")
    assert out["input_ids"].shape[0] == 2
    per_sample = (out["input_ids"] == proc.image_token_id).sum(-1).tolist()
    counts = [int(g.prod()) // 4 for g in out["image_grid_thw"]]
    assert per_sample == [counts[0], counts[1] + counts[2]]


def test_one_image_list_per_text(proc):
    # each text gets its own list; a list that does not match its text is an error (the images were handed out in
    # order across the batch: sample 1's image went to sample 0)
    images = [_noise(30, 30, seed=i) for i in range(3)]
    nested = proc(text=[f"{MEDIA_PAD}the cat", "a dog"], images=[[images[0]], []], padding=True, return_tensors="pt")
    tokens = int(nested["image_grid_thw"][0].prod()) // 4
    assert (nested["input_ids"] == proc.image_token_id).sum(-1).tolist() == [tokens, 0]
    for second, lists, match in (("a dog", [[], [images[0]]], "text 0 holds 1 image placeholder.*has 0"),
                                 (MEDIA_PAD * 2, [images[:2], images[2:]], "text 0 holds 1 image placeholder.*has 2"),
                                 ("a dog", [[images[0]]], "1 per-text lists for 2 texts")):
        with pytest.raises(InvalidMediaError, match=match):  # the batch's totals match in the first two
            proc(text=[f"{MEDIA_PAD}the cat", second], images=lists, padding=True)


def test_one_video_list_per_text(proc):
    # as for images: a per-text video list that does not match its text is an error, not handed to another text
    clips = [np.stack([_noise(28, 28, seed=i)] * 2) for i in range(3)]
    kwargs = {"do_sample_frames": False, "padding": True, "return_tensors": "pt"}
    out = proc(text=["the cat", VIDEO_PLACEHOLDER], videos=[[], [clips[0]]], **kwargs)
    assert (out["input_ids"] == proc.video_token_id).sum(-1).tolist() == [0, 1]
    for texts, lists, match in (([VIDEO_PLACEHOLDER, "a dog"], [[], [clips[0]]], "text 0 holds 1 video placeholder.*has 0"),
                                ([VIDEO_PLACEHOLDER, VIDEO_PLACEHOLDER * 2], [clips[:2], clips[2:]],
                                 "text 0 holds 1 video placeholder.*has 2"),
                                ([VIDEO_PLACEHOLDER, "a dog"], [[clips[0]]], "1 per-text lists for 2 texts")):
        with pytest.raises(InvalidMediaError, match=match):  # the batch's totals match in the first two
            proc(text=texts, videos=lists, **kwargs)
    # videos given as frame lists are a flat batch of videos, not one list per text
    frames = [[_noise(28, 28, seed=i)] * 2 for i in range(2)]
    out = proc(text=[VIDEO_PLACEHOLDER * 2, "a dog"], videos=frames, **kwargs)
    assert (out["input_ids"] == proc.video_token_id).sum(-1).tolist() == [2, 0]


def test_per_text_video_lists_of_pathlike_files(proc, media):
    """`pathlib.Path` video files in per-text lists count as the `str` paths do (they were dropped when counting)."""
    kwargs = {"num_frames": 4, "padding": True, "return_tensors": "pt"}
    expected = proc(text=["the cat", VIDEO_PLACEHOLDER], videos=[[], [str(media["video"])]], **kwargs)
    out = proc(text=["the cat", VIDEO_PLACEHOLDER], videos=[[], [media["video"]]], **kwargs)
    for key in ("input_ids", "pixel_values_videos", "video_grid_thw"):
        assert torch.equal(out[key], expected[key]), key


@pytest.mark.parametrize("text, match", [([], "an empty list"), (5, "of type int"), ([1, "a"], "a list of int, str")])
def test_text_must_be_strings(proc, text, match):
    with pytest.raises(ConfigError, match=f"text must be a string or a non-empty list of strings, got {match}"):
        proc(text=text)


def test_chat_template_refuses_empty_conversations_and_audio(proc):
    hello = [{"role": "user", "content": "hi"}]
    for conversation, at in (([], 0), ([[]], 0), ([hello, []], 1)):
        with pytest.raises(ConfigError, match=f"conversation {at} is an empty list"):
            proc.apply_chat_template(conversation, tokenize=True)
    audio = [{"role": "user", "content": [{"type": "audio", "path": "x.wav"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(InvalidMediaError, match="not audio; remove the audio part of conversation 0"):
        proc.apply_chat_template(audio, tokenize=True, return_dict=True)
    assert len(proc.apply_chat_template([hello, hello], tokenize=True)) == 2


def test_text_only(proc, tok):
    out = proc(text="the cat")
    assert set(out.keys()) == {"input_ids", "attention_mask"}
    assert out["input_ids"][0] == tok.encode("the cat")


# --- videos ------------------------------------------------------------------------------------------------------------
def test_video_expansion(proc, tok, media):
    out = proc(text=f"{VIDEO_PLACEHOLDER}describe", videos=[media["video"]], num_frames=6, return_tensors="pt")
    assert set(out.keys()) == {"input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw"}
    grids = out["video_grid_thw"]
    assert grids[:, 0].tolist() == [4, 2]  # chunks of temporal_patch_size frames
    text = tok.decode(out["input_ids"][0])
    chunks = CHUNK_RE.findall(text)
    assert text == "".join(f"{ts}<|media_start|>video<|media_content|>{pads}<|media_end|>" for ts, pads in chunks) + (
        "describe"
    )
    per_chunk = [pads.count(VIDEO_PLACEHOLDER) for _, pads in chunks]
    assert per_chunk == [int(g[1:].prod()) // 4 for g in grids]
    assert sum(per_chunk) == proc.video_processor.get_num_video_tokens(6, 48, 64)
    assert int((out["input_ids"] == proc.video_token_id).sum()) == sum(per_chunk)
    assert int((out["input_ids"] == proc.image_token_id).sum()) == 0  # video tokens keep their own id
    # frames 0, 1, 3, 5 | 6, 8 of a 10 fps clip: chunks start at 0 s and 0.6 s
    assert [ts for ts, _ in chunks] == ["00:00:00.000", "00:00:00.600"]


def test_image_and_video_order(proc, tok, media):
    image = _noise(60, 60)
    text = f"{IMAGE_PROMPT}alpha{VIDEO_PLACEHOLDER}omega"
    out = proc(text=text, images=[image], videos=[str(media["video"])], num_frames=4)
    ids = out["input_ids"][0]
    assert pad_runs(ids, proc.image_token_id) == [int(out["image_grid_thw"][0].prod()) // 4]
    assert pad_runs(ids, proc.video_token_id) == [int(g[1:].prod()) // 4 for g in out["video_grid_thw"]]
    decoded = tok.decode(ids)
    assert decoded.index("alpha") < decoded.index("<|media_start|>video") < decoded.index("omega")


def test_decoded_frames_video(proc, tok):
    frames = np.stack([_noise(28, 28, seed=i) for i in range(6)])
    out = proc(
        text=VIDEO_PLACEHOLDER,
        videos=[frames],
        video_metadata=[{"fps": 2.0, "total_num_frames": 6}],
        do_sample_frames=False,
    )
    stamps = [ts for ts, _ in CHUNK_RE.findall(tok.decode(out["input_ids"][0]))]
    assert stamps == ["00:00:00.000", "00:00:02.000"]
    # without metadata the timestamps assume 24 fps (with a warning)
    out = proc(text=VIDEO_PLACEHOLDER, videos=[frames], do_sample_frames=False)
    stamps = [ts for ts, _ in CHUNK_RE.findall(tok.decode(out["input_ids"][0]))]
    assert stamps == ["00:00:00.000", "00:00:00.166"]


def test_variable_frame_rate_chunk_timestamps(proc, tok, tmp_path):
    """A screen recording with variable frame timing: chunks are stamped with the times their first frames were
    sampled at (12 samples over 7.041 s, one every 0.587 s: chunks of 4 start at 0, 2.347 and 4.694 s; a frame on
    screen across several samples is stamped with each one's time), not `index / average fps`, by the processor and
    through the chat template."""
    path = write_vfr_video(tmp_path / "screen.mkv")  # 7.041 s, frames at VFR_PTS_MS; 2 fps -> 12 samples
    out = proc(text=VIDEO_PLACEHOLDER, videos=[path], fps=2, return_metadata=True)
    stamps = [ts for ts, _ in CHUNK_RE.findall(tok.decode(out["input_ids"][0]))]
    assert stamps == ["00:00:00.000", "00:00:02.346", "00:00:04.693"]  # milliseconds truncated
    meta = out["video_metadata"][0]
    assert meta.frames_indices == [0, 4, 5, 5, 5, 5, 9, 9, 9, 9, 9, 10]
    np.testing.assert_allclose(meta.timestamps, np.arange(12) * meta.duration / 12)
    assert meta.timestamps == meta.frames_timestamps
    assert meta.duration == pytest.approx(7.041, abs=1e-3)
    messages = _user({"type": "video", "path": str(path)}, {"type": "text", "text": "Code it."})
    chat = proc.apply_chat_template(messages, tokenize=True, return_dict=True, processor_kwargs={"fps": 2})
    assert [ts for ts, _ in CHUNK_RE.findall(tok.decode(chat["input_ids"][0]))] == stamps


@pytest.mark.parametrize(
    "settings, stamps",
    [
        ({"do_sample_frames": False}, ["00:00:00.000", "00:00:00.320", "00:00:00.640", "00:00:00.960",
                                       "00:00:01.280", "00:00:01.600", "00:00:01.920"]),
        ({"fps": 3}, ["00:00:00.000", "00:00:01.280"]),
        ({"fps": 7.5}, ["00:00:00.000", "00:00:00.480", "00:00:01.040", "00:00:01.600"]),
        ({"num_frames": 5}, ["00:00:00.000", "00:00:01.600"]),
    ],
)
def test_constant_rate_chunk_timestamps_are_pinned(proc, tok, tmp_path, settings, stamps):
    """Constant-rate files keep `index / fps` chunk timestamps (12.5 fps: decord's float32 start times fall just
    below whole milliseconds, which would read 0.319, 0.639, ...)."""
    path = test_media.write_video(tmp_path / "c.mp4", np.zeros((25, 48, 64, 3), np.uint8), fps=Fraction(25, 2))
    out = proc(text=VIDEO_PLACEHOLDER, videos=[path], **settings)
    assert [ts for ts, _ in CHUNK_RE.findall(tok.decode(out["input_ids"][0]))] == stamps


def test_video_metadata_frame_times(proc, tok):
    frames = np.stack([_noise(28, 28, seed=i) for i in range(6)])
    meta = TimedVideoMetadata(total_num_frames=40, fps=24.0, frames_indices=[0, 2, 4, 6, 8, 10],
                              frames_timestamps=[0.0, 0.5, 1.0, 1.5, 2.0, 12.5])
    out = proc(text=VIDEO_PLACEHOLDER, videos=[frames], video_metadata=[meta], do_sample_frames=False)
    assert [ts for ts, _ in CHUNK_RE.findall(tok.decode(out["input_ids"][0]))] == ["00:00:00.000", "00:00:02.000"]
    meta.frames_timestamps = [0.0, 0.5]
    with pytest.raises(InvalidMediaError, match="frames_timestamps holds 2 times for 6 processed frames"):
        proc(text=VIDEO_PLACEHOLDER, videos=[frames], video_metadata=[meta], do_sample_frames=False)


def test_format_timestamp():
    assert format_timestamp(0) == "00:00:00.000"
    assert format_timestamp(3661.2345) == "01:01:01.234"


def test_num_multimodal_tokens(proc):
    data = proc._get_num_multimodal_tokens(image_sizes=[(40, 60), (300, 200)], video_sizes=[(6, 48, 64)])
    assert data["num_image_tokens"] == [proc.image_processor.get_num_image_tokens(h, w) for h, w in [(40, 60), (300, 200)]]
    assert data["num_video_tokens"] == [proc.video_processor.get_num_video_tokens(6, 48, 64)]


# --- mismatches --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, n_images, match",
    [
        (f"{MEDIA_PAD}{MEDIA_PAD}", 1, r"2 image placeholder.*but 1 image"),
        ("no placeholder", 1, r"0 image placeholder.*but 1 image"),
        (f"{MEDIA_PAD}", 0, r"1 image placeholder.*but 0 image"),
    ],
)
def test_image_mismatch(proc, text, n_images, match):
    images = [_noise(30, 30)] * n_images or None
    with pytest.raises(InvalidMediaError, match=match):
        proc(text=text, images=images)


@pytest.mark.parametrize(
    "text, n_videos, match",
    [
        (VIDEO_PLACEHOLDER, 2, r"1 video placeholder.*but 2 video"),
        (VIDEO_PLACEHOLDER * 2, 1, r"2 video placeholder.*but 1 video"),
        (VIDEO_PLACEHOLDER, 0, r"1 video placeholder.*but 0 video"),
    ],
)
def test_video_mismatch(proc, media, text, n_videos, match):
    videos = [str(media["video"])] * n_videos or None
    with pytest.raises(InvalidMediaError, match=match):
        proc(text=text, videos=videos)


def test_tokenizer_without_media_tokens():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={"a": 0}, merges=[])))
    with pytest.raises(ConfigError, match="media tokens"):
        KimiVLProcessor(MoonViTImageProcessor(), plain, MoonViTVideoProcessor())


# --- chat template -----------------------------------------------------------------------------------------------------
def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_chat_template_media_sources(proc, media):
    array = _noise(50, 90, seed=1)
    sources = [
        {"type": "image", "image": Image.fromarray(array)},
        {"type": "image", "path": str(media["png"])},
        {"type": "image", "url": media["png"].as_uri()},
        {"type": "image", "image": array},
    ]
    messages = _user(*sources, {"type": "text", "text": "Same?"})
    prompt = proc.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == f"<|im_user|>user<|im_middle|>{IMAGE_PROMPT * 4}Same?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    out = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert set(out.keys()) == {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"}
    assert out["image_grid_thw"].shape[0] == 4
    # the same picture from four sources gives the same pixels
    per_image = out["pixel_values"].reshape(4, -1)
    for i in range(1, 4):
        torch.testing.assert_close(per_image[i], per_image[0])
    direct = proc(text=prompt, images=[array] * 4, return_tensors="pt")
    assert torch.equal(direct["input_ids"], out["input_ids"])


def test_chat_template_base64_image_part(proc, media):
    # transformers hands a part's bare `base64` payload to the processor as is
    payload = base64.b64encode(media["png"].read_bytes()).decode()
    part = {"type": "image", "base64": payload}
    messages = _user(part, {"type": "text", "text": "Same?"})
    out = proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert part == {"type": "image", "base64": payload}  # the caller's message is left as it was
    expected = proc.apply_chat_template(_user({"type": "image", "path": str(media["png"])}, {"type": "text", "text": "Same?"}),
                                        tokenize=True, return_dict=True, return_tensors="pt")
    for key in ("input_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(out[key], expected[key]), key


def test_chat_template_video(proc, tok, media):
    messages = _user({"type": "video", "path": str(media["video"])}, {"type": "text", "text": "Code it."})
    out = proc.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, processor_kwargs={"num_frames": 6}
    )
    assert set(out.keys()) == {"input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw"}
    text = tok.decode(out["input_ids"][0])
    assert text.startswith("<|im_user|>user<|im_middle|>00:00:00.000<|media_start|>video<|media_content|>")
    assert text.endswith("<|media_end|>Code it.<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert len(CHUNK_RE.findall(text)) == out["video_grid_thw"].shape[0] == 2
    # a file:// URL works too
    messages = _user({"type": "video", "url": media["video"].as_uri()}, {"type": "text", "text": "Code it."})
    again = proc.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, processor_kwargs={"num_frames": 6}
    )
    assert again["input_ids"] == out["input_ids"]


def test_chat_template_video_of_frame_files(proc, tok, media, tmp_path):
    """A video part given as a list of frame image files (transformers' convention) is one video of those frames,
    through the chat template and a direct call with transformers' nesting, also beside a video file."""
    frames = np.stack([_noise(28, 28, seed=i) for i in range(6)])
    paths = []
    for i, frame in enumerate(frames):
        paths.append(str(tmp_path / f"frame{i}.png"))
        Image.fromarray(frame).save(paths[-1])
    expected = proc(text=VIDEO_PLACEHOLDER, videos=[frames], do_sample_frames=False, return_tensors="pt")
    messages = _user({"type": "video", "video": paths}, {"type": "text", "text": "Code it."})
    chat = proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                    processor_kwargs={"do_sample_frames": False})
    direct = proc(text=VIDEO_PLACEHOLDER, videos=[[paths]], do_sample_frames=False, return_tensors="pt")
    for out in (chat, direct):
        for key in ("pixel_values_videos", "video_grid_thw"):
            assert torch.equal(out[key], expected[key]), key
        assert int((out["input_ids"] == proc.video_token_id).sum()) == int((expected["input_ids"] == proc.video_token_id).sum())
    file = proc(text=VIDEO_PLACEHOLDER, videos=[media["video"]], num_frames=4, return_tensors="pt")
    frames4 = proc(text=VIDEO_PLACEHOLDER, videos=[frames], num_frames=4, return_tensors="pt")
    counts = [int((x["input_ids"] == proc.video_token_id).sum()) for x in (file, frames4)]
    for texts, videos in (([VIDEO_PLACEHOLDER, VIDEO_PLACEHOLDER], [[media["video"]], [paths]]),
                          ([VIDEO_PLACEHOLDER * 2], [[media["video"], paths]])):
        out = proc(text=texts, videos=videos, num_frames=4, padding=True, return_tensors="pt")
        assert (out["input_ids"] == proc.video_token_id).sum(-1).tolist() in (counts, [sum(counts)])
        assert out["video_grid_thw"][:, 0].tolist() == [4, 4]


def test_chat_template_batch_text_only_conversation(proc, media):
    conversations = [
        _user({"type": "image", "path": str(media["png"])}, {"type": "text", "text": "What?"}),
        [{"role": "user", "content": "the cat"}],
    ]
    out = proc.apply_chat_template(conversations, tokenize=True, return_dict=True, padding=True, return_tensors="pt")
    assert out["input_ids"].shape[0] == 2 and out["image_grid_thw"].shape[0] == 1
    assert int((out["input_ids"][1] == proc.image_token_id).sum()) == 0


def test_chat_template_missing_file(proc, tmp_path):
    messages = _user({"type": "image", "path": str(tmp_path / "nope.png")}, {"type": "text", "text": "?"})
    with pytest.raises(InvalidMediaError, match="does not exist"):
        proc.apply_chat_template(messages, tokenize=True, return_dict=True)


# --- decoding ----------------------------------------------------------------------------------------------------------
def test_post_process_strips_template(proc, tok):
    prompt = proc.apply_chat_template(_user({"type": "text", "text": "What is red?"}), add_generation_prompt=True)
    prompt_ids = proc(text=prompt)["input_ids"][0]
    answer = tok.encode("the cat is red.")
    end, pad = tok.convert_tokens_to_ids(IM_END), tok.pad_token_id
    full = prompt_ids + answer + [end, pad, pad]
    assert proc.post_process_image_text_to_text(full) == "the cat is red."
    assert proc.post_process_image_text_to_text(torch.tensor(full)) == "the cat is red."
    # a batch (left-padded prompts), and generated ids without the prompt
    short = tok.encode("blue")
    fill = len(answer) - len(short)
    batch = torch.tensor([[pad, *prompt_ids, *answer, end], [*prompt_ids, *short, end, *[pad] * (fill + 1)]])
    assert proc.post_process_image_text_to_text(batch) == ["the cat is red.", "blue"]
    assert proc.post_process_image_text_to_text([answer + [end]]) == ["the cat is red."]
    # no end of turn yet: everything after the header
    assert proc.post_process_image_text_to_text(prompt_ids + answer) == "the cat is red."
    # a list of rows of different lengths (tensors or arrays), as `batch_decode` takes
    rows = [torch.tensor(answer + [end]), torch.tensor(short + [end, pad])]
    assert proc.post_process_image_text_to_text(rows) == ["the cat is red.", "blue"]
    assert proc.post_process_image_text_to_text([r.numpy() for r in rows]) == ["the cat is red.", "blue"]


def test_decode_forwarding(proc, tok):
    ids = tok.encode(f"the cat{IM_END}")
    assert proc.decode(ids) == f"the cat{IM_END}"
    assert proc.batch_decode([ids], skip_special_tokens=True) == ["the cat"]


# --- save / load -------------------------------------------------------------------------------------------------------
def test_save_load_round_trip(tok, media, tmp_path):
    proc = KimiVLProcessor(MoonViTImageProcessor(max_patches=64), tok, MoonViTVideoProcessor(fps=4, max_patches=32))
    proc.save_pretrained(tmp_path)
    loaded = KimiVLProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded.image_processor, MoonViTImageProcessor)
    assert isinstance(loaded.video_processor, MoonViTVideoProcessor)
    assert loaded.image_processor.max_patches == 64
    assert (loaded.video_processor.fps, loaded.video_processor.max_patches) == (4, 32)
    assert loaded.chat_template == proc.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.eos_token == IM_END and len(loaded.tokenizer) == len(tok)
    messages = _user(
        {"type": "image", "path": str(media["png"])},
        {"type": "video", "path": str(media["video"])},
        {"type": "text", "text": "the cat"},
    )
    kwargs = {"add_generation_prompt": True, "tokenize": True, "return_dict": True, "return_tensors": "pt"}
    a, b = proc.apply_chat_template(messages, **kwargs), loaded.apply_chat_template(messages, **kwargs)
    assert a.keys() == b.keys() == {"input_ids", "attention_mask"} | MEDIA_KEYS
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_auto_processor(proc, tmp_path):
    if not hasattr(kimi_vl, "KimiVLConfig"):
        pytest.skip("AutoProcessor registration needs kimi_vl.KimiVLConfig")
    proc.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiVLProcessor)
    assert loaded.chat_template == CHAT_TEMPLATE


# --- with the model ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_outputs_feed_the_model(proc, tok, media):
    """Processor outputs run through `KimiVLForConditionalGeneration` (ids from the tokenizer)."""
    from tests.test_export import tiny_model

    model = tiny_model(proc)
    messages = _user(
        {"type": "video", "path": str(media["video"])},
        {"type": "image", "image": _noise(56, 56)},
        {"type": "text", "text": "the cat"},
    )
    inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt", processor_kwargs={"num_frames": 6})
    logits = model(**inputs).logits
    assert logits.shape == (*inputs["input_ids"].shape, len(tok))
    assert torch.isfinite(logits).all()
