"""Zero-vision SFT data: text-only conversations, answer formats, loss on assistant turns only."""

import re

import pytest

from kimi_vl.data import assistant_mask, embedded_sft_stream, encode_chat
from kimi_vl.data.chats import CODE_REQUEST, sft_conversations
from kimi_vl.tokenization.special_tokens import IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER, MEDIA_START

SEQ, ROWS = 256, 4


@pytest.fixture(scope="module")
def conversations():
    return sft_conversations(120, seed=0)


def test_deterministic_text_only_conversations(conversations):
    assert conversations == sft_conversations(120, seed=0)
    assert conversations != sft_conversations(120, seed=1)
    assert sft_conversations(10, seed=0) == conversations[:10]
    for conv in conversations:
        assert [m["role"] for m in conv][-2:] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) for m in conv)  # no image / video parts anywhere
        assert not any(MEDIA_START in m["content"] or "<|" in m["content"] for m in conv)


def test_answer_formats_and_python_traces(conversations):
    pages = [c[-1]["content"] for c in conversations if c[-1]["content"].startswith("<html>")]
    assert pages and all(p.endswith("</body></html>") for p in pages)  # the video2web answer format, from text
    conversations = [c for c in conversations if not c[-1]["content"].startswith("<html>")]
    replies = [c[-1]["content"] for c in conversations]
    prompts = [c[-2]["content"] for c in conversations]
    final = r"The answer is \S+(, \(\w\))*\.$"  # option-letter drills answer with a list of letters
    assert all(re.search(final, r) for r in replies), [r for r in replies if not re.search(final, r)]
    mc = [r for r, p in zip(replies, prompts) if "Options:" in p and "Which letters" not in p]
    assert mc and all(re.search(r"The answer is \([A-J]\)\.$", r) for r in mc)
    assert any("Think step by step" in p for p in prompts)  # MMLU-Pro prompts
    assert any(p.startswith("Hint: ") or "\nHint: " in p for p in prompts)  # MathVista hints
    traces = [(p, r) for p, r in zip(prompts, replies) if "```python" in r]
    assert len(traces) > 10
    # code exactly when the user asks for it; the other described-image questions get the task's short reply
    assert all(p.endswith(CODE_REQUEST) for p, _ in traces)
    direct = [(p, r) for p, r in zip(prompts, replies) if "image.png is" in p and "```" not in r]
    assert direct and all(not p.endswith(CODE_REQUEST) and len(r) < 200 for p, r in direct)
    assert any("image.png is" in p and "ndimage.label" in r for p, r in traces)  # counting by pixel operations
    assert any("Image.open" in r and "print(img[" in r for _, r in traces)  # reading a pixel's colour
    # the stated results are the answers
    for p, r in traces:
        if "ndimage.label(m)[1]" in r:
            n = int(re.search(r"It prints (\d+)\.", r).group(1))
            assert r.endswith(f"The answer is {n}.") or "Choices" in p
            assert p.count("[") - p.count("[x0") == n  # one described object per counted region


def test_encode_chat_loss_only_on_assistant(proc, conversations):
    tok = proc.tokenizer
    for conv in conversations[:30]:
        doc = encode_chat(conv, proc)
        target = "".join(m["content"] + IM_END for m in conv if m["role"] == "assistant")
        assert tok.decode([t for t, lab in zip(doc.input_ids, doc.labels) if lab != -100]) == target
        roles = {tok.convert_tokens_to_ids(t) for t in (IM_USER, IM_SYSTEM, IM_ASSISTANT, IM_MIDDLE)}
        assert not any(lab in roles for lab in doc.labels)


def test_assistant_mask_state_machine(proc):
    tok = proc.tokenizer
    ids = tok("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>yo<|im_end|>",
              add_special_tokens=False)["input_ids"]
    mask = assistant_mask(ids, proc)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "yo<|im_end|>"


def test_sft_stream_is_zero_vision_and_masked(proc):
    stream = embedded_sft_stream(proc, seq_len=SEQ, rows=ROWS, seed=0)
    tok = proc.tokenizer
    user, system, end = (tok.convert_tokens_to_ids(t) for t in (IM_USER, IM_SYSTEM, IM_END))
    for i in range(3):
        b = stream.batch(i)
        assert b.input_ids.shape == (1, SEQ * ROWS)
        assert b.num_vision_tokens == 0 and b.pixel_values is None and b.pixel_values_videos is None
        assert "<|media" not in tok.decode(b.input_ids[0]) and "video_placeholder" not in tok.decode(b.input_ids[0])
        assert b.num_loss_tokens > 0
        ids, labels, cu = b.input_ids[0].tolist(), b.labels[0].tolist(), b.cu_seqlens.tolist()
        checked = 0
        for a, e in zip(cu, cu[1:]):
            if ids[a] in (user, system) and ids[e - 1] == end:  # a whole conversation
                mask = assistant_mask(ids[a:e], proc)
                assert labels[a:e] == [t if m else -100 for t, m in zip(ids[a:e], mask)]
                checked += 1
        assert checked >= 3
    assert stream.batch(1).input_ids.equal(embedded_sft_stream(proc, seq_len=SEQ, rows=ROWS, seed=0).batch(1).input_ids)
    # gap filling keeps the padding low
    pads = [stream.batch(i).num_pad_tokens / (SEQ * ROWS) for i in range(3)]
    assert sum(pads) / 3 < 0.2, pads


def test_lookup_drill_and_the_evaluation_layout(conversations):
    """The option-letter drill is in the mixture, and the MMLU-Pro prompt the evaluation sends (the local layout)
    is the most frequent multiple-choice layout."""
    drills = [c for c in conversations if "Which letters do the options" in c[-2]["content"]]
    assert drills and all(c[-2]["content"].startswith("Options:\nA. ") for c in drills)
    mc = [c[-2]["content"] for c in conversations if "Answer: Let's think step by step." in c[-2]["content"]]
    local = [p for p in mc if "where X is the correct letter choice.\n\n\n\nQuestion:\n" in p]
    assert len(local) > len(mc) / 3


def test_page_conversations_fit_a_tiny_sft_row(proc):
    """The tiny preset's SFT rows hold a page conversation whole (a cut one loses its closing tags' context)."""
    import random

    from kimi_vl.data.chats import _page
    from kimi_vl.training.presets import get_preset

    seq_len = get_preset("tiny").data["sft"].seq_len
    lengths = []
    for i in range(40):
        prompt, reply = _page(random.Random(i))
        lengths.append(len(encode_chat([{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": reply}], proc).input_ids))
    assert max(lengths) <= seq_len and min(lengths) > 256, (min(lengths), max(lengths), seq_len)
