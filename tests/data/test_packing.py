"""Documents and packing: label masks, row layout, cu_seqlens, media tensors, vision ratio, determinism, and a tiny
model trained one step on a packed batch."""

import itertools
import math
import random
import re

import numpy as np
import pytest
import torch

from kimi_vl.data import (
    Document,
    PackedStream,
    drill_option_range,
    encode_chat,
    encode_sample,
    encode_text,
    option_drill_document,
)
from kimi_vl.data import embedded_pretrain_stream as pretrain_stream
from kimi_vl.data.config import DataConfig
from kimi_vl.data.encode import Media, encode_document
from kimi_vl.data.world import make_sample, sample_rng
from kimi_vl.errors import ConfigError, ShapeError
from kimi_vl.text.modeling import causal_lm_loss
from kimi_vl.tokenization.special_tokens import (
    BOS,
    DOC_EOS,
    IM_END,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    MEDIA_START,
)

SEQ, ROWS = 256, 4


def tid(proc, token):
    return proc.tokenizer.convert_tokens_to_ids(token)


def loss_text(proc, doc):
    return proc.tokenizer.decode([t for t, lab in zip(doc.input_ids, doc.labels) if lab != -100])


@pytest.fixture(scope="module")
def stream(proc):
    return pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0)


@pytest.fixture(scope="module")
def batches(stream):
    return [stream.batch(i) for i in range(8)]


# ----------------------------------------------------------------------------------------------------- documents
def test_encode_text(proc):
    doc = encode_text("x = 1  # [EOS] <|im_end|>", proc)
    assert doc.input_ids[0] == tid(proc, BOS) and doc.input_ids[-1] == tid(proc, DOC_EOS)
    assert doc.labels == [-100] + doc.input_ids[1:] and doc.splittable
    # special-token strings inside the text stay text
    assert doc.input_ids.count(tid(proc, DOC_EOS)) == 1 and tid(proc, IM_END) not in doc.input_ids
    assert proc.tokenizer.decode(doc.input_ids[1:-1]) == "x = 1  # [EOS] <|im_end|>"
    with pytest.raises(ShapeError, match="labels"):
        Document([1, 2], [1])


def _media_positions(proc, ids):
    media = {tid(proc, t) for t in (MEDIA_START, MEDIA_CONTENT, MEDIA_END)} | {proc.image_token_id,
                                                                              proc.video_token_id}
    return [i for i, t in enumerate(ids) if t in media]


def test_encode_sample_pretrain_image(proc):
    s = make_sample("count", sample_rng(0, 1))
    doc = encode_sample(s, proc, chat=False)
    grid = doc.media["image_grid_thw"]
    assert grid.shape == (1, 3) and doc.media["pixel_values"].shape[0] == int(grid.prod())
    assert doc.input_ids.count(proc.image_token_id) == int(grid.prod()) // 4
    last = max(i for i, t in enumerate(doc.input_ids) if t == tid(proc, MEDIA_END))
    assert all(lab == -100 for lab in doc.labels[: last + 1])  # [BOS], markers, "image", placeholders
    assert doc.labels[last + 1:] == doc.input_ids[last + 1:]
    assert all(doc.labels[i] == -100 for i in _media_positions(proc, doc.input_ids))
    assert loss_text(proc, doc) == f"Question: {s.question}\nAnswer: {s.response}{DOC_EOS}"
    assert not doc.splittable and doc.images == [s.image]


def test_encode_sample_chat(proc):
    s = make_sample("visual_math", sample_rng(0, 2))
    doc = encode_sample(s, proc, chat=True)
    assert loss_text(proc, doc) == s.response + IM_END
    assert doc.input_ids.count(proc.image_token_id) == int(doc.media["image_grid_thw"].prod()) // 4
    text = proc.tokenizer.decode(doc.input_ids)
    assert text.startswith("<|im_user|>user<|im_middle|><|media_start|>image<|media_content|><|media_pad|>")
    assert s.question in text


def test_encode_sample_video(proc):
    s = make_sample("screencast", sample_rng(0, 3))
    doc = encode_sample(s, proc, chat=False)
    grids = doc.media["video_grid_thw"]
    assert grids.shape[0] == math.ceil(len(s.video.frames) / 4)  # chunks of 4 frames
    assert doc.input_ids.count(proc.video_token_id) == sum(int(g[1] * g[2]) // 4 for g in grids)
    assert doc.media["pixel_values_videos"].shape[0] == int(grids.prod(-1).sum())
    text = proc.tokenizer.decode(doc.input_ids)
    assert "00:00:00.000<|media_start|>video" in text and "00:00:01.000<|media_start|>video" in text  # 4 fps
    assert loss_text(proc, doc) == f"Question: {s.question}\nAnswer: {s.video.html}{DOC_EOS}"  # timestamps masked
    chat = encode_sample(s, proc, chat=True)
    assert loss_text(proc, chat) == s.video.html + IM_END


def test_encode_chat_masks_everything_but_the_assistant(proc):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "The answer is 4."}, {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "content": "The answer is 6."}]
    doc = encode_chat(messages, proc)
    assert loss_text(proc, doc) == f"The answer is 4.{IM_END}The answer is 6.{IM_END}"
    assert not doc.media and not doc.splittable
    with pytest.raises(ConfigError, match="messages"):
        encode_chat([{"content": "no role"}], proc)


def test_media_in_an_assistant_turn_carry_no_loss(proc):
    """An image (or video) in an assistant turn is input: its block, `<|media_start|>` to `<|media_end|>`, has no
    label, as everywhere else; the turn's text around it keeps its loss."""
    image = make_sample("count", sample_rng(0, 0)).image
    messages = [{"role": "user", "content": "Show me."},
                {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, {"type": "image", "image": image},
                                                  {"type": "text", "text": " done."}]}]
    doc = encode_chat(messages, proc)
    assert loss_text(proc, doc) == f"Here: done.{IM_END}"
    assert tid(proc, MEDIA_PAD) in doc.input_ids


# ----------------------------------------------------------------------------------------------------- batches
def test_layout_and_cu_seqlens(batches):
    for b in batches:
        assert b.input_ids.shape == b.labels.shape == (1, ROWS * SEQ)
        assert b.input_ids.dtype == b.labels.dtype == torch.long
        cu = b.cu_seqlens.tolist()
        assert b.cu_seqlens.dtype == torch.int32
        assert cu[0] == 0 and cu[-1] == ROWS * SEQ and all(x < y for x, y in zip(cu, cu[1:]))
        assert {r * SEQ for r in range(ROWS + 1)} <= set(cu)  # every row boundary is a segment boundary
        assert b.num_tokens == ROWS * SEQ and b.rows == ROWS and b.seq_len == SEQ


def test_no_loss_on_media_or_padding(proc, batches):
    for b in batches:
        ids, labels = b.input_ids[0].tolist(), b.labels[0].tolist()
        assert all(labels[i] == -100 for i in _media_positions(proc, ids))
        pad = proc.tokenizer.pad_token_id
        assert all(lab == -100 for t, lab in zip(ids, labels) if t == pad)
        assert all(lab in (-100, t) for t, lab in zip(ids, labels))
        cu = b.cu_seqlens.tolist()
        for a, e in zip(cu, cu[1:]):  # padding is a segment of its own
            seg = ids[a:e]
            assert pad not in seg or set(seg) == {pad}


def test_placeholders_match_the_pixels(proc, batches):
    seen_video = False
    for b in batches:
        ids = b.input_ids
        n_img = int((ids == proc.image_token_id).sum())
        if b.image_grid_thw is None:
            assert n_img == 0 and b.pixel_values is None
        else:
            assert n_img == int(b.image_grid_thw.prod(-1).sum()) // 4
            assert b.pixel_values.shape == (int(b.image_grid_thw.prod(-1).sum()), 3, 14, 14)
        n_vid = int((ids == proc.video_token_id).sum())
        if b.video_grid_thw is None:
            assert n_vid == 0 and b.pixel_values_videos is None
        else:
            seen_video = True
            assert n_vid == int((b.video_grid_thw[:, 1] * b.video_grid_thw[:, 2]).sum()) // 4
            assert b.pixel_values_videos.shape[0] == int(b.video_grid_thw.prod(-1).sum())
        assert b.num_vision_tokens == n_img + n_vid
        # in order: the k-th run of placeholders has the size of the k-th image / video chunk
        for token, grids in ((proc.image_token_id, b.image_grid_thw), (proc.video_token_id, b.video_grid_thw)):
            if grids is not None:
                assert _runs(ids[0].tolist(), token) == [int(g[1] * g[2]) // 4 for g in grids]
    assert seen_video


def _runs(ids, token):
    runs, n = [], 0
    for t in ids + [None]:
        if t == token:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_vision_ratio_from_the_first_batch(batches):
    ratios = [b.num_vision_tokens / b.num_tokens for b in batches]
    assert all(abs(r - 0.25) <= 0.07 for r in ratios), ratios  # within about one screencast (~40 tokens) per batch
    assert abs(sum(ratios) / len(ratios) - 0.25) <= 0.03, ratios


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.2])
def test_vision_ratio_targets(proc, ratio):
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=5, vision_ratio=ratio, video_fraction=0.0)
    ratios = [s.batch(i).num_vision_tokens / (ROWS * SEQ) for i in range(3)]
    assert all(abs(r - ratio) <= 0.04 for r in ratios), ratios


def test_batches_are_pure_functions_of_seed_and_index(proc, stream, batches):
    def same(a, b):
        return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(
            (a.input_ids, a.labels, a.cu_seqlens, a.pixel_values, a.image_grid_thw, a.pixel_values_videos),
            (b.input_ids, b.labels, b.cu_seqlens, b.pixel_values, b.image_grid_thw, b.pixel_values_videos)))

    fresh = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0)
    assert same(fresh.batch(5), batches[5]) and same(stream.batch(2), batches[2])  # any order, any instance
    assert not torch.equal(batches[0].input_ids, batches[1].input_ids)
    other = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=1)
    assert not torch.equal(other.batch(0).input_ids, batches[0].input_ids)


def test_num_loss_tokens_matches_the_loss(batches):
    b = batches[0]
    vocab = int(b.input_ids.max()) + 1
    logits = torch.zeros(1, b.num_tokens, vocab, requires_grad=True)
    loss = causal_lm_loss(logits, b.labels, b.cu_seqlens) * b.num_loss_tokens
    loss.backward()
    # each target row of the gradient sums to zero, and the rows that got gradient are the counted targets
    counted = int((logits.grad.abs().sum(-1) > 0).sum())
    assert counted == b.num_loss_tokens > 0


def test_to_and_model_inputs(batches):
    b = batches[0].to("cpu")
    inputs = b.model_inputs()
    assert set(inputs) >= {"input_ids", "labels", "cu_seqlens", "pixel_values", "image_grid_thw"}
    assert all(v is not None for v in inputs.values())


# ----------------------------------------------------------------------------------------------------- packing rules
def _fixed(n, splittable=False, token=100):
    return lambda draws: Document([token] * n, [token] * n, splittable=splittable)


def test_whole_documents_go_to_the_next_row_and_leave_padding():
    s = PackedStream(_fixed(100), seq_len=256, rows=3, seed=0, max_misses=0)
    b = s.batch(0)
    assert b.cu_seqlens.tolist() == [0, 100, 200, 256, 356, 456, 512, 612, 712, 768]
    ids, labels = b.input_ids[0], b.labels[0]
    assert (ids[200:256] == 2).all() and (labels[200:256] == -100).all()  # [PAD] id of build_tokenizer
    assert b.num_pad_tokens == 3 * 56


def test_splittable_documents_fill_rows():
    s = PackedStream(_fixed(300, splittable=True), seq_len=256, rows=3, seed=0)
    b = s.batch(0)
    assert b.cu_seqlens.tolist() == [0, 256, 300, 512, 600, 768]
    assert b.num_pad_tokens == 0


def test_long_documents_are_cut_at_row_starts():
    lengths = itertools.chain([50, 600], itertools.repeat(10))
    s = PackedStream(lambda draws: _fixed(next(lengths))(draws), seq_len=256, rows=4, seed=0, max_misses=0)
    b = s.batch(0)
    # 50 + pad, then 600 = 256 + 256 + 88 from a row start, then the 10-token documents
    assert b.cu_seqlens.tolist()[:7] == [0, 50, 256, 512, 768, 856, 866]


def test_gap_filling_draws_fit_shorter_documents():
    def doc(draws):
        n = draws.rng.choice((40, 200))
        return Document([7] * n, [7] * n)

    tight = PackedStream(doc, seq_len=256, rows=8, seed=0, max_misses=4).batch(0)
    loose = PackedStream(doc, seq_len=256, rows=8, seed=0, max_misses=0).batch(0)
    assert tight.num_pad_tokens < loose.num_pad_tokens


def test_a_cut_never_falls_inside_media(proc):
    """A long document whose row cut would fall inside its image block ends its piece before the block (the rest
    of the row is padding) and continues with the whole block at the next row start; a block longer than a row
    is refused."""
    doc = encode_sample(make_sample("count", sample_rng(0, 1)), proc, chat=False)
    media_start = doc.input_ids.index(tid(proc, MEDIA_START))
    block = doc.input_ids.index(tid(proc, MEDIA_END)) + 1 - media_start
    seq_len = block - 1  # after [BOS] the first row would end before the image's last placeholder
    b = PackedStream(lambda draws: doc, seq_len=seq_len, rows=3, seed=0, processor=proc).batch(0)
    rows = b.input_ids.view(3, seq_len)
    pad = proc.tokenizer.pad_token_id
    assert rows[0, :media_start].tolist() == doc.input_ids[:media_start]
    assert (rows[0, media_start:] == pad).all() and (b.labels.view(3, seq_len)[0, media_start:] == -100).all()
    assert rows[1].tolist() == doc.input_ids[media_start: media_start + seq_len]  # the block, from a row start
    assert seq_len in b.cu_seqlens.tolist() and media_start in b.cu_seqlens.tolist()
    assert int((b.input_ids == proc.image_token_id).sum()) == int(b.image_grid_thw.prod(-1).sum()) // 4
    with pytest.raises(ConfigError, match="does not fit in a row"):
        PackedStream(lambda draws: doc, seq_len=block - 2, rows=2, seed=0, processor=proc).batch(0)


def test_a_video_chunk_keeps_its_timestamp_across_a_cut(proc):
    """A long video document is cut between chunks: each chunk's `HH:MM:SS.mmm` timestamp (its block's start, as
    the processor writes it) goes to the next row with the chunk, never left at the end of the previous row or cut
    in two."""
    frames = [np.full((28, 28, 3), 10 * t, np.uint8) for t in range(24)]  # 6 chunks of 4 frames at 2 fps
    doc = encode_document(["A clip ", Media("video", frames), " ends."], proc)
    seq_len = 40
    b = PackedStream(lambda draws: doc, seq_len=seq_len, rows=4, seed=0, processor=proc).batch(0)
    rows = [proc.tokenizer.decode(r) for r in b.input_ids.view(4, seq_len).tolist()]
    stamp = r"\d\d:\d\d:\d\d\.\d{3}" + re.escape(f"{MEDIA_START}video")
    assert [len(re.findall(stamp, r)) for r in rows] == [r.count(f"{MEDIA_START}video") for r in rows]
    assert sum(len(re.findall(stamp, r)) for r in rows) == len(b.video_grid_thw) >= 3  # more than one row's
    assert not any(re.search(r"[\d:.]+(\[PAD\])*$", r) for r in rows)  # no timestamp left at a row's end


def test_bad_arguments(proc):
    with pytest.raises(ConfigError, match="vision_documents"):
        PackedStream(_fixed(3), seq_len=8, rows=1, seed=0, vision_ratio=0.2)
    with pytest.raises(ConfigError, match="vision_ratio"):
        PackedStream(_fixed(3), seq_len=8, rows=1, seed=0, vision_ratio=1.5, vision_documents=_fixed(3))
    with pytest.raises(ConfigError, match="empty document"):
        PackedStream(_fixed(0), seq_len=8, rows=1, seed=0).batch(0)
    with pytest.raises(ConfigError, match="batch index"):
        PackedStream(_fixed(3), seq_len=8, rows=1, seed=0).batch(-1)


def test_mixture_weights_and_chat_form_of_world_text(proc):
    """`text_tasks` / `vision_tasks` pick the world tasks (weight 0 or absent: never); `text_chat_fraction=1` puts
    every world text sample in chat form (loss on the reply only, the question and options unlabelled)."""
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=3, code_fraction=0.0, video_fraction=0.0,
                        text_chat_fraction=1.0, text_tasks={"lookup": 1.0, "mc": 0.0}, vision_tasks={"count": 1})
    tok = proc.tokenizer
    lookups = answers = 0
    for i in range(2):
        b = s.batch(i)
        text = tok.decode(b.input_ids[0].tolist())
        assert text.count("Which letters do the options") == text.count("Options:") >= 1
        assert "How many legs" not in text and "What color" not in text and "What is" not in text  # no mc/arith
        assert text.count("How many") == len(b.image_grid_thw)  # only counting images
        labelled = tok.decode([t for t, lab in zip(b.input_ids[0].tolist(), b.labels[0].tolist()) if lab != -100])
        assert "Options:" not in labelled and "Which letters" not in labelled  # prompts carry no loss
        lookups, answers = lookups + text.count("Which letters"), answers + labelled.count("The option ")
    assert lookups >= 2 and answers >= 3 * lookups
    with pytest.raises(ConfigError, match="text_tasks"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, text_tasks={"count": 1.0})
    with pytest.raises(ConfigError, match="vision_tasks"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, vision_tasks={"count": 0.0})
    with pytest.raises(ConfigError, match="text_chat_fraction"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, text_chat_fraction=2.0)


def test_video_tasks_pick_the_world_video_tasks(proc):
    """By default every video document is a whole-page `screencast`; `video_tasks` weights bring in `page_color`
    (one short colour reply per page) and `page_swatch` (one-colour videos) and can leave the screencasts out."""
    def videos(**kw):
        s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=5, code_fraction=1.0, video_fraction=1.0,
                            vision_ratio=0.3, **kw)
        text = "".join(proc.tokenizer.decode(s.batch(i).input_ids.reshape(-1).tolist()) for i in range(2))
        return text.count("Write the HTML"), text.count("of this web page?"), text.count("color is the web page?")

    pages, colours, swatches = videos()
    assert pages >= 2 and colours == swatches == 0
    pages, colours, swatches = videos(video_tasks={"page_color": 1.0})
    assert pages == swatches == 0 and colours >= 2
    pages, colours, swatches = videos(video_tasks={"page_color": 1.0, "page_swatch": 1.0})
    assert pages == 0 and colours >= 1 and swatches >= 1
    with pytest.raises(ConfigError, match="video_tasks"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, video_tasks={"count": 1.0})


def test_option_drill_document_labels_only_the_letters(proc):
    tok = proc.tokenizer
    for i in range(20):
        doc = option_drill_document(sample_rng(0, i, "drill"), proc, lookups=4)
        text = tok.decode(doc.input_ids)
        assert text.startswith(BOS + "Options:\nA. ") and text.endswith(DOC_EOS) and not doc.splittable
        options = dict(re.findall(r"\n([A-J])\. ([^\n]+)", text))
        found = re.findall(r"The option (.+?) is \(([A-J])\)\.", text)
        assert len(options) == 10 and len(found) == 4 and all(options[letter] == v for v, letter in found)
        assert loss_text(proc, doc) == "".join(letter for _, letter in found)


def test_option_drill_document_any_letters(proc):
    """With `any_letters` a question of k options is lettered by k distinct letters of A-J in order, each letter is a
    target somewhere, and each looked-up letter is the one heading its value; without it the letters run from A."""
    tok = proc.tokenizer
    targets = set()
    for i in range(40):
        doc = option_drill_document(sample_rng(0, i, "drill"), proc, 10, 2, 3, any_letters=True)
        text = tok.decode(doc.input_ids)
        letters = re.findall(r"\n([A-J])\. ", text)
        options = dict(re.findall(r"\n([A-J])\. ([^\n]+)", text))
        found = re.findall(r"The option (.+?) is \(([A-J])\)\.", text)
        assert 2 <= len(letters) <= 3 and letters == sorted(set(letters)) and len(found) == len(letters)
        assert all(options[letter] == v for v, letter in found)
        assert loss_text(proc, doc) == "".join(letter for _, letter in found)
        targets.update(letter for _, letter in found)
        plain = tok.decode(option_drill_document(sample_rng(0, i, "drill"), proc, 10, 2, 3).input_ids)
        assert re.findall(r"\n([A-J])\. ", plain) == list("ABC")[: len(re.findall(r"\n[A-J]\. ", plain))]
    assert targets == set("ABCDEFGHIJ")
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=4, drill_batches=2, drill_ramp_batches=2,
                        drill_lookups=3, vision_ratio=0.1, drill_any_letters=True)
    firsts = [block[1] for i in range(2) for block in tok.decode(s.batch(i).input_ids[0].tolist()).split("Options:")[1:]]
    assert firsts and set(firsts) - {"A"}, firsts


def test_drill_option_range_starts_easy():
    assert [drill_option_range(i, 200, 3) for i in (0, 99, 100, 199, 200, 449)] == [
        (2, 3), (2, 3), (2, 6), (2, 6), (3, 10), (3, 10)]
    assert drill_option_range(0, 0, 3) == (3, 10)  # no ramp: all options from the start


def test_drill_ramp_grows_the_option_lists(proc):
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=4, drill_batches=10, drill_ramp_batches=4,
                        drill_lookups=3, vision_ratio=0.1)
    tok = proc.tokenizer

    def option_counts(i):
        text = tok.decode(s.batch(i).input_ids[0].tolist())
        return [len(re.findall(r"\n[A-J]\. ", block)) for block in text.split("Options:")[1:]]

    counts = {i: option_counts(i) for i in range(10)}
    assert all(counts[i] and all(2 <= c <= 3 for c in counts[i]) for i in (0, 1)), counts
    assert all(counts[i] and all(2 <= c <= 6 for c in counts[i]) for i in (2, 3)), counts
    assert max(counts[2] + counts[3]) > 3 and max(c for i in range(4, 10) for c in counts[i]) > 6, counts
    with pytest.raises(ConfigError, match="drill_ramp_batches"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, drill_batches=2, drill_ramp_batches=-1)
    with pytest.raises(ConfigError, match="min_options <= max_options"):
        option_drill_document(random.Random(0), proc, 3, 6, 4)


def test_warmup_stream_drills_then_mixes(proc):
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=2, drill_batches=2, drill_lookups=3)
    plain = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=2)
    tok = proc.tokenizer
    for i in (0, 1):
        b = s.batch(i)
        text = tok.decode(b.input_ids[0].tolist())
        assert text.count("The option ") >= 6 and b.image_grid_thw is not None  # drills, and images as usual
        assert abs(b.num_vision_tokens / b.input_ids.numel() - 0.25) < 0.07
        labelled = tok.decode([t for t, lab in zip(b.input_ids[0].tolist(), b.labels[0].tolist()) if lab != -100])
        assert "Options:" in text and "Options:" not in labelled  # drills: only their letters carry the loss
        assert "Answer:" not in text and "<html" not in text  # images in chat form (short replies), no screencasts
    for i in (2, 3):  # afterwards the mixture itself
        assert torch.equal(s.batch(i).input_ids, plain.batch(i).input_ids)
    assert torch.equal(s.batch(0).input_ids, s.batch(0).input_ids)
    with pytest.raises(ConfigError, match="drill_batches"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, drill_batches=-1)


def test_drill_has_its_own_vision_ratio(proc):
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=3, drill_batches=2, vision_ratio=0.25,
                        drill_vision_ratio=0.1, video_fraction=0.0)
    drill = [s.batch(i).num_vision_tokens / (SEQ * ROWS) for i in (0, 1)]
    main = [s.batch(i).num_vision_tokens / (SEQ * ROWS) for i in (2, 3)]
    assert all(abs(r - 0.1) < 0.05 for r in drill) and all(abs(r - 0.25) < 0.07 for r in main), (drill, main)
    with pytest.raises(ConfigError, match="drill_vision_ratio"):
        DataConfig(drill_vision_ratio=1.5)
    for name, value, match in (("video_fraction", float("nan"), r"video_fraction must be in \[0, 1\]"),
                               ("chat_fraction", -0.5, "chat_fraction must be in"),
                               ("video_fps", float("nan"), "video_fps must be a positive, finite frame rate"),
                               ("video_fps", 0.0, "video_fps must be a positive")):
        with pytest.raises(ConfigError, match=match):
            DataConfig(**{name: value})


def test_drill_media_tasks_may_name_video_tasks(proc):
    """`drill_vision_tasks` may bring a video task (`page_color`) into the drill, as a short-reply chat; a task of
    neither kind is refused."""
    s = pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=6, drill_batches=2, vision_ratio=0.3,
                        drill_vision_tasks={"page_color": 1.0})
    drill = [s.batch(i) for i in (0, 1)]
    text = "".join(proc.tokenizer.decode(b.input_ids.reshape(-1).tolist()) for b in drill)
    assert text.count("of this web page?") >= 2 and "Write the HTML" not in text
    assert all(b.pixel_values_videos is not None and b.pixel_values is None for b in drill)
    with pytest.raises(ConfigError, match="drill_vision_tasks"):
        pretrain_stream(proc, seq_len=SEQ, rows=ROWS, seed=0, drill_batches=2, drill_vision_tasks={"mc": 1.0})


# ----------------------------------------------------------------------------------------------------- the model
def test_tiny_model_trains_on_a_packed_batch(proc, batches):
    from tests.test_export import tiny_model

    model = tiny_model(proc).train()
    b = next(x for x in batches if x.pixel_values is not None and x.pixel_values_videos is not None)
    out = model(**b.model_inputs())
    assert torch.isfinite(out.loss)
    assert out.logits.shape == (1, ROWS * SEQ, len(proc.tokenizer))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(n.startswith("vision_tower") and g.abs().sum() > 0 for n, g in grads.items())
    # the loss is the one over the batch's labels
    expected = causal_lm_loss(out.logits.detach(), b.labels, b.cu_seqlens)
    assert torch.allclose(out.loss.detach(), expected)
    random.seed(0)
