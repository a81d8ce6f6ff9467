"""Users' record schemas (`kimi_vl.data.formats`): detection, parsing into documents / chats / prompts, placeholder
rules, every kind of bad record, media reading, and the encoding of parsed records as training would do it."""

import json

import numpy as np
import pytest
import torch

from kimi_vl.data.encode import Media, encode_chat, encode_document, encode_prompt
from kimi_vl.data.formats import (
    MediaRef,
    Record,
    default_reward,
    detect_format,
    get_format,
    parse_record,
)
from kimi_vl.errors import BadRecordError, ConfigError, InvalidMediaError
from kimi_vl.training.rewards import reward
from tests.data.userdata import image, png_bytes


def parse(row, base=None, fmt=None, **kw) -> Record:
    return parse_record(row, get_format(fmt) if fmt else None, base, **kw)


def texts(record):
    return [p["text"] for m in record.messages for p in m["content"] if p["type"] == "text"]


def test_detection_by_keys():
    cases = {"messages": {"messages": []}, "sharegpt": {"conversations": []}, "verl": {"prompt": [],
             "reward_model": {}}, "easyr1": {"problem": "", "answer": ""}, "obelics": {"texts": [], "images": []},
             "text": {"text": ""}, "webdataset": {"__key__": "k"}}
    for name, row in cases.items():
        assert detect_format(row).name == name
    with pytest.raises(BadRecordError, match="no known schema has the keys"):
        detect_format({"question": "q"})
    with pytest.raises(BadRecordError, match="not a JSON object"):
        detect_format([1, 2])
    assert get_format("llava").name == "sharegpt"
    # a Parquet file (or JSON with nulls) mixing schemas has every column in every row, None where a row has none
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert parse({"messages": None, "text": "a document", "images": None}).format == "text"
    assert parse({"messages": chat, "text": None, "images": None}).format == "messages"
    llava = parse({"conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "a"}],
                   "image": "1.png", "images": None})  # LLaVA's `image` next to another set's `images`
    assert [r.value for r in llava.media()] == ["1.png"]
    with pytest.raises(BadRecordError, match="no RL answer"):  # keys holding None still name the schema otherwise
        parse({"problem": "1 + 1?", "answer": None})
    with pytest.raises(ConfigError, match="unknown data format"):
        get_format("alpaca")


def test_text_documents_and_placeholders(tmp_path):
    doc = parse({"text": "a <image> b <video> c", "images": ["x.png"], "videos": ["v.mp4"]}, tmp_path)
    assert doc.kind == "document" and doc.format == "text"
    assert [s if isinstance(s, str) else s.kind for s in doc.segments] == ["a ", "image", " b ", "video", " c"]
    assert doc.segments[1].resolve_path("x.png") == str(tmp_path / "x.png")
    prepended = parse({"text": "caption", "images": ["1.png", "2.png"]})  # media, no placeholder: prepended
    assert [getattr(s, "kind", s) for s in prepended.segments] == ["image", "image", "caption"]
    with pytest.raises(BadRecordError, match="2 <image> and 0 <video> placeholders but the record has 1 images"):
        parse({"text": "<image><image>", "images": ["1.png"]})
    with pytest.raises(BadRecordError, match="no 'text'"):
        parse({"text": None}, fmt="text")


def test_obelics_and_webdataset():
    doc = parse({"texts": ["A", None, "B", "C"], "images": [None, "p.png", None, None]})
    assert [getattr(s, "kind", s) for s in doc.segments] == ["A", "image", "B\n\nC"]
    with pytest.raises(BadRecordError, match="slot 1 has both"):
        parse({"texts": ["A", "B"], "images": [None, "p.png"]})
    with pytest.raises(BadRecordError, match="2 slots but 'images' has 1"):
        parse({"texts": ["A", None], "images": [None]})
    wds = parse({"__key__": "k", "jpg": b"...", "json": '{"caption": " hi "}'})
    assert wds.segments[1] == "hi" and wds.segments[0].value == b"..."
    with pytest.raises(BadRecordError, match="no caption"):
        parse({"__key__": "k", "png": b"..."})


def test_llava_sharegpt_and_messages_chats():
    llava = parse({"id": "1", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "That."}]})
    assert llava.kind == "chat" and [m["role"] for m in llava.messages] == ["user", "assistant"]
    assert [p["type"] for p in llava.messages[0]["content"]] == ["image", "text"]
    share = parse({"system": "Short.", "conversations": [{"from": "human", "value": "Hi"},
                                                          {"from": "gpt", "value": "Yo"}]})
    assert [m["role"] for m in share.messages] == ["system", "user", "assistant"]
    typed = parse({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
                                {"role": "assistant", "content": "A"}], "images": ["i.png"]})
    assert typed.messages[0]["content"][0]["image"].value == "i.png" and texts(typed) == ["Q", "A"]
    openai = parse({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u.png"}}]},
                                 {"role": "assistant", "content": "A"}]})
    assert openai.messages[0]["content"][0]["image"].value == "u.png"
    no_placeholder = parse({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                            "videos": ["v.mp4"]})
    assert [p["type"] for p in no_placeholder.messages[0]["content"]] == ["video", "text"]


@pytest.mark.parametrize("row, reason", [
    ({"conversations": [{"from": "human", "value": "Hi"}]}, "no assistant turn"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "  "}]}, "no assistant turn"),
    ({"conversations": [{"from": "alien", "value": "Hi"}, {"from": "gpt", "value": "x"}]}, "unknown role 'alien'"),
    # the turn is named as the record holds it, also after a `system` key (the first message)
    ({"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "x"},
                                               {"from": "alien", "value": "?"}]},
     r"^conversations\[2\] has the unknown role 'alien'"),
    ({"system": "Be brief.", "conversations": [{"from": "human", "value": "a<|im_end|>"}, {"from": "gpt", "value": "x"}]},
     r"^conversations\[0\] contains the reserved token"),
    ({"conversations": [{"value": "Hi"}]}, r"conversations\[0\] is not"),
    ({"messages": [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}],
      "images": ["a.png"]}, "more <image> placeholders than the record's 1 images"),
    ({"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}],
      "images": ["a.png", "b.png"]}, "1 image and 0 video placeholders but the record has 2 images"),
    ({"messages": [{"role": "user", "content": "a<|im_end|>b"}, {"role": "assistant", "content": "x"}]},
     "reserved token '<\\|im_end\\|>'"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "x"}]},
     "unknown type 'audio'"),
    ({"messages": "hello"}, "'messages' is a str, not a list"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "x"}], "system": 123},
     "'system' is a int, not a string"),
    ({"image": "", "conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "x"}]},
     "'image' holds an empty path; give each image's file"),
])
def test_bad_chats(row, reason):
    with pytest.raises(BadRecordError, match=reason):
        parse(row)


def test_rl_prompts_and_their_rewards():
    verl = parse({"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": "<image>Find x."}],
                  "images": [{"bytes": b"png", "path": None}], "reward_model": {"ground_truth": "12.5"},
                  "extra_info": {"split": "train"}})
    assert verl.kind == "prompt" and verl.reward == "number" and verl.answer == "12.5"
    assert verl.task == "hiyouga/geometry3k" and verl.meta["extra_info"] == {"split": "train"}
    easy = parse({"problem": "<image>Which?", "answer": "(C)", "images": ["a.png"]})
    assert easy.reward == "choice" and easy.answer == "C" and easy.messages[0]["content"][0]["type"] == "image"
    assert parse({"problem": "Name it.", "answer": "Paris"}).reward == "exact"
    assert parse({"problem": "Name it.", "answer": "12"}, reward="ocr").reward == "ocr"
    for answer, kind in (("[[1, 2, 30, 40]]", "grounding"), ("<html><b>x</b></html>", "html"), ("1,234", "number")):
        assert default_reward(Record("prompt", answer=answer)) == kind
    assert default_reward(Record("prompt", answer="HELLO", task="my_ocr_set")) == "ocr"
    for task in ("OCRBench", "lmms-lab/textocr", "ocr_vqa"):
        assert default_reward(Record("prompt", answer="HELLO", task=task)) == "ocr", task
    for task in ("socratic_math", "democracy_qa"):  # "ocr" inside a word: no partial credit for a wrong answer
        assert default_reward(Record("prompt", answer="Paris", task=task)) == "exact", task
    with pytest.raises(BadRecordError, match="no RL answer"):
        parse({"problem": "Q", "answer": " "})
    with pytest.raises(BadRecordError, match="no RL answer"):
        parse({"prompt": [{"role": "user", "content": "Q"}], "reward_model": {}})
    with pytest.raises(BadRecordError, match="no RL answer.*NaN"):  # a float column's missing value, not "nan"
        parse({"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": float("nan")}})
    with pytest.raises(BadRecordError, match="does not end with a user turn"):
        parse({"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
               "reward_model": {"ground_truth": "1"}})
    with pytest.raises(ConfigError, match="unknown reward"):
        parse({"problem": "Q", "answer": "1"}, reward="vibes")


def test_media_are_read_from_paths_bytes_structs_and_frame_lists(tmp_path):
    image(0).save(tmp_path / "a.png")
    assert MediaRef("image", "a.png", tmp_path).load().size == (56, 42)
    assert MediaRef("image", png_bytes(image(1)), None).load().size == (56, 42)
    assert MediaRef("image", {"bytes": None, "path": str(tmp_path / "a.png")}).load().mode == "RGB"
    frames = MediaRef("video", ["a.png", "a.png"], tmp_path).load()
    assert isinstance(frames, np.ndarray) and frames.shape == (2, 42, 56, 3)
    with pytest.raises(InvalidMediaError, match="does not exist"):
        MediaRef("image", "gone.png", tmp_path).load()
    with pytest.raises(InvalidMediaError, match="does not exist"):
        MediaRef("video", "gone.mp4", tmp_path).load()
    with pytest.raises(InvalidMediaError, match="only local paths"):
        MediaRef("image", "https://example.com/a.png", tmp_path).load()
    image(2, 20, 20).save(tmp_path / "b.png")
    with pytest.raises(InvalidMediaError, match="different sizes"):
        MediaRef("video", ["a.png", "b.png"], tmp_path).load()


def test_parsed_records_encode_like_training(proc, tmp_path):
    """A document's text carries the loss and its image block does not; a LLaVA chat trains on the reply only; a
    verl prompt renders with the generation prompt and its image tensors."""
    image(3).save(tmp_path / "a.png")
    doc = parse({"text": "see <image> here", "images": ["a.png"]}, tmp_path)
    encoded = encode_document(doc.loaded(), proc)
    n_img = encoded.input_ids.count(proc.image_token_id)
    assert n_img == int(encoded.media["image_grid_thw"].prod()) // 4
    assert all(lab == -100 for t, lab in zip(encoded.input_ids, encoded.labels) if t == proc.image_token_id)
    assert proc.tokenizer.decode([t for t in encoded.labels if t != -100]).startswith("see ")
    chat = parse({"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                      {"from": "gpt", "value": "Noise."}]}, tmp_path)
    c = encode_chat(chat.loaded(), proc)
    assert proc.tokenizer.decode([t for t in c.labels if t != -100]) == "Noise.<|im_end|>"
    prompt = parse({"problem": "<image>Which?", "answer": "B", "images": ["a.png"]}, tmp_path).loaded()
    ids, media = encode_prompt(prompt, proc)
    assert proc.tokenizer.decode(ids).endswith("<|im_assistant|>assistant<|im_middle|>") and media["pixel_values"].ndim == 4
    assert torch.equal(media["image_grid_thw"], encoded.media["image_grid_thw"])
    plain = encode_document(parse({"text": "a <|im_end|> b"}).loaded(), proc)  # documents: special strings stay text
    assert proc.tokenizer.convert_tokens_to_ids("<|im_end|>") not in plain.input_ids
    assert isinstance(doc.loaded()[1], Media)


def test_a_forced_reward_must_fit_the_answer():
    with pytest.raises(BadRecordError, match="holds no number"):
        parse({"problem": "Q", "answer": "\\frac{a}{b}"}, reward="number")
    with pytest.raises(BadRecordError, match="not an option letter"):
        parse({"problem": "Q", "answer": "12"}, reward="choice")
    with pytest.raises(BadRecordError, match="not a list of"):
        parse({"problem": "Q", "answer": "left"}, reward="grounding")
    assert parse({"problem": "Q", "answer": "\\frac{2}{3}"}).reward == "exact"


@pytest.mark.parametrize("row, reward, reason", [
    ({"problem": "Big?", "answer": "1e400"}, None, r"'1e400' holds no finite number .*pass --reward exact"),
    ({"problem": "Version?", "answer": "v2.0.1"}, "number", r"'v2.0.1' holds no number.*pick another --reward"),
    ({"problem": "Q", "answer": [1, 2]}, None, r"list of 2 values \(\[1, 2\]\); give one ground truth"),
    ({"problem": "Q", "answer": []}, None, "list of 0 values"),
    ({"problem": "Q", "answer": [{"a": 1}]}, None, "the RL answer is a dict"),
    ({"problem": "Where?", "answer": "[[1,2,3]]"}, None, r"box \[1,2,3\], which is not four numbers"),
    ({"problem": "Where?", "answer": "[[1,2,3,4],[5,6]]"}, None, r"box \[5,6\], which is not four numbers"),
    ({"problem": "Where?", "answer": "[[1,2,3,4],[a,b,c,d]]"}, "grounding", "not four numbers"),
    ({"problem": "", "answer": "1"}, None, "'problem' is empty"),
    ({"problem": " \n", "answer": "1"}, None, "'problem' is empty"),
    ({"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": ["1", "2"]}}, None,
     "list of 2 values"),
])
def test_rl_rows_the_reward_cannot_score_are_bad_records(row, reward, reason):
    """What the reward would refuse (or silently misread) at training time is refused when the row is read."""
    with pytest.raises(BadRecordError, match=reason):
        parse(row, reward=reward)


def test_rl_answers_that_can_be_scored():
    assert parse({"problem": "Q", "answer": [7]}).answer == "7"  # a list of one ground truth is that truth
    assert parse({"problem": "Q", "answer": 5}).reward == "number"
    assert parse({"problem": "Q", "answer": "1e300"}).reward == "number"
    assert parse({"problem": "Q", "answer": "1e400"}, reward="exact").answer == "1e400"
    boxes = parse({"problem": "Where?", "answer": "[[1, 2, 3, 4], [5.5, 6, 7, 8]]"})
    assert boxes.reward == "grounding" and boxes.answer == "[[1, 2, 3, 4], [5.5, 6, 7, 8]]"


def test_commas_make_a_number_answer_only_as_thousands_separators():
    """`3,5` (a decimal comma) or `2,3` (two roots) was taken for a number whose true value is its first one: the
    reply `\\boxed{3}` scored 1 and the exact `\\boxed{3,5}` 0. They are compared as text now."""
    for truth in ("3,5", "2,3", "-1,3", "1,00", "1,2345"):
        record = parse({"problem": "Q", "answer": truth})
        assert record.reward == "exact"
        assert reward(record, rf"\boxed{{{truth}}}") == 1.0 and reward(record, r"\boxed{3}") == 0.0
    for truth in ("1,234", "-12,345.5", "1,000,000"):
        assert parse({"problem": "Q", "answer": truth}).reward == "number"


def test_boxed_ground_truths_are_read_as_their_box():
    """A ground truth written as a worked solution ending in `\\boxed{...}` was compared whole: every reply scored 0
    (silently: `data check` found the rows good)."""
    for truth, kind, answer in ((r"\boxed{12}", "number", "12"), (r"x = 3 + 9, so \boxed{12}.", "number", "12"),
                                (r"\boxed{\dfrac{1}{2}}", "exact", r"\dfrac{1}{2}"), (r"\boxed{(B)}", "choice", "B")):
        record = parse({"problem": "Q", "answer": truth})
        assert (record.reward, record.answer) == (kind, answer)
    assert reward(parse({"problem": "Q", "answer": r"so \boxed{\frac12}"}), r"The answer is \boxed{0.5}") == 1.0
    with pytest.raises(BadRecordError, match="boxes nothing"):
        parse({"problem": "Q", "answer": r"\boxed{}"})


def test_grounding_answers_given_as_json_lists_of_boxes():
    """The README's grounding answer `[[x0, y0, x1, y1], ...]` written as JSON (or a Parquet list column) rather than
    as a string was a bad record ("a list of 2 values", or for one box "a list, not a string")."""
    for truth, verl in (([[1, 2, 3, 4]], False), ([[1, 2, 3, 4], [5.5, 6, 7, 8]], True)):
        row = ({"prompt": [{"role": "user", "content": "Where?"}], "reward_model": {"ground_truth": truth}} if verl
               else {"problem": "Where?", "answer": truth})
        record = parse(row)
        assert record.reward == "grounding" and json.loads(record.answer) == truth
    with pytest.raises(BadRecordError, match=r"list of 4 values .*grounding boxes as \[\[x0, y0, x1, y1\], ...\]"):
        parse({"problem": "Where?", "answer": [1, 2, 3, 4]})  # one flat box: four answers or a box? Refused


def test_inline_data_uri_images(tmp_path):
    """OpenAI-style `image_url` parts with a base64 `data:` URI are decoded as images (never joined to the data
    folder); a malformed one is an error whose message does not print the blob."""
    import base64

    uri = "data:image/png;base64," + base64.b64encode(png_bytes(image(4))).decode()
    chat = parse({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                            {"type": "text", "text": "What?"}]},
                               {"role": "assistant", "content": "Noise."}]}, tmp_path)
    loaded = chat.loaded()[0]["content"][0]["image"]
    assert loaded.mode == "RGB" and loaded.size == (56, 42)
    assert np.array_equal(np.asarray(loaded), np.asarray(image(4)))
    assert MediaRef("image", uri.replace(";base64", ";charset=x;base64"), tmp_path).load().size == (56, 42)
    broken = uri[:-40] + "!!!" + "A" * 4000
    with pytest.raises(InvalidMediaError, match="invalid base64 payload") as err:
        MediaRef("image", broken, tmp_path).load()
    assert "A" * 100 not in str(err.value) and "characters)" in str(err.value) and len(str(err.value)) < 300
    with pytest.raises(InvalidMediaError, match="no ','"):
        MediaRef("image", "data:image/png;base64", tmp_path).load()
    with pytest.raises(InvalidMediaError, match="cannot be read as an image"):
        MediaRef("image", "data:image/png;base64," + base64.b64encode(b"not a png").decode(), tmp_path).load()
    with pytest.raises(InvalidMediaError, match="images only") as err:
        MediaRef("video", uri, tmp_path).load()
    assert len(str(err.value)) < 300
    with pytest.raises(InvalidMediaError, match="only local paths") as err:  # a long URL is shortened too
        MediaRef("image", "https://example.com/" + "x" * 5000 + ".png", tmp_path).load()
    assert len(str(err.value)) < 300


def test_trl_grpo_rows():
    """TRL's GRPO datasets (`prompt` as a string or a chat, `solution` or `answer`, `image` for VLMs) were refused
    ("more than 100 bad records in a row" from `train rl`); a worked `solution` is read from its last box, and a verl
    row keeps its schema."""
    text = parse({"prompt": "What is 7 + 5?", "solution": r"7 + 5 = 12, so the answer is \boxed{12}."})
    assert (text.format, text.kind, text.reward, text.answer, text.task) == ("trl", "prompt", "number", "12", "trl")
    assert text.messages == [{"role": "user", "content": [{"type": "text", "text": "What is 7 + 5?"}]}]
    chat = parse({"prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": "<image>Colour?"}],
                  "answer": "red", "image": "cat.png"})
    assert chat.format == "trl" and [m["role"] for m in chat.messages] == ["system", "user"]
    assert [r.value for r in chat.media()] == ["cat.png"] and chat.reward == "exact"
    assert parse({"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": "4"},
                  "answer": "x"}).format == "verl"
    with pytest.raises(BadRecordError, match="'prompt' is empty"):
        parse({"prompt": " ", "solution": "1"})
    with pytest.raises(BadRecordError, match="does not end with a user turn"):
        parse({"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "solution": "1"})


def test_a_folder_given_as_a_video_is_named_as_a_folder(tmp_path):
    """LLaVA-style data sometimes names a folder of frames as the `video`: the bad-record reason says it is a folder
    and how to give its frames, not that the path does not exist."""
    (tmp_path / "clip").mkdir()
    image(0).save(tmp_path / "clip" / "000.png")
    with pytest.raises(InvalidMediaError, match="is a folder; give a video file, or the folder's frame images"):
        MediaRef("video", "clip", tmp_path).load()


def test_llava_next_video_records_mark_their_video_with_image():
    """LLaVA-Video-178K / LLaVA-OneVision video records (LLaVA-NeXT's format) hold a `video` and put `<image>` where
    it goes: the video goes there. With an image in the record, or a `<video>` placeholder, `<image>` stays an image
    placeholder (a count that then does not match is still a bad record)."""
    record = parse({"id": "v_1", "video": "clips/1.mp4", "data_source": "0_30_s_academic_v0_1", "conversations": [
        {"from": "human", "value": "<image>\nWhat happens?"}, {"from": "gpt", "value": "A dog runs."},
        {"from": "human", "value": "Then?"}, {"from": "gpt", "value": "It sits."}]})
    assert [p["type"] for p in record.messages[0]["content"]] == ["video", "text"]
    assert record.messages[0]["content"][0]["video"].value == "clips/1.mp4" and texts(record)[0] == "\nWhat happens?"
    mixed = parse({"image": "a.png", "video": "v.mp4", "conversations": [
        {"from": "human", "value": "<image> and <video>?"}, {"from": "gpt", "value": "x"}]})
    assert [p["type"] for p in mixed.messages[0]["content"]] == ["image", "text", "video", "text"]
    with pytest.raises(BadRecordError, match="more <image> placeholders than the record's 0 images"):
        parse({"videos": ["a.mp4"], "conversations": [{"from": "human", "value": "<image><image>"},
                                                      {"from": "gpt", "value": "x"}]})
