"""Tokenizer builder and chat template: byte-level round trip, special tokens, save/load, exact prompt strings."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kimi_vl.errors import ConfigError
from kimi_vl.tokenization import (
    BOS,
    CHAT_TEMPLATE,
    DOC_EOS,
    IM_END,
    KIMI_DEFAULT_SYSTEM_PROMPT,
    MEDIA_PAD,
    MIN_VOCAB_SIZE,
    PAD,
    SPECIAL_TOKENS,
    VIDEO_PLACEHOLDER,
    build_tokenizer,
    render_chat,
)

WORDS = "the a cat dog sees red blue green square circle count three two one image video chart how many is what".split()


def sentences(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(sentences(), 400)


# --- building ----------------------------------------------------------------------------------------------------------
def test_vocab_and_roles(tok):
    assert MIN_VOCAB_SIZE < len(tok) <= 400
    assert len(tok) > MIN_VOCAB_SIZE + 20  # merges were learned
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, IM_END, PAD)
    assert tok.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert tok.image_token == MEDIA_PAD and tok.video_token == VIDEO_PLACEHOLDER
    assert tok.chat_template == CHAT_TEMPLATE
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    # nothing is added automatically (no BOS / EOS post-processing)
    assert tok("the cat")["input_ids"] == tok.encode("the cat", add_special_tokens=False)


def test_merges_compress(tok):
    text = "the cat sees the dog."
    assert len(tok.encode(text)) < len(text.encode())


def test_generator_input():
    tok = build_tokenizer((s for s in sentences(50)), MIN_VOCAB_SIZE + 10, min_frequency=1)
    assert len(tok) == MIN_VOCAB_SIZE + 10


@pytest.mark.parametrize("vocab_size", [0, 256, MIN_VOCAB_SIZE - 1])
def test_vocab_too_small(vocab_size):
    with pytest.raises(ConfigError, match=str(MIN_VOCAB_SIZE)):
        build_tokenizer(sentences(10), vocab_size)


@pytest.mark.parametrize("texts", [[], ["", ""], iter([])])
def test_empty_texts(texts):
    with pytest.raises(ConfigError, match="empty"):
        build_tokenizer(texts, 400)


def test_bad_texts():
    with pytest.raises(ConfigError, match="not one string"):
        build_tokenizer("some text", 400)
    with pytest.raises(ConfigError, match=r"texts\[1\]"):
        build_tokenizer(["ok", 3], 400)
    with pytest.raises(ConfigError, match="min_frequency"):
        build_tokenizer(["ok"], 400, min_frequency=0)


# --- round trip and special tokens -------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_round_trip_any_unicode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == text


@pytest.mark.parametrize(
    "text", ["  leading and trailing  ", "tabs\tand\nnewlines\r\n", "héllo 世界 🎉 \x00\x7f", "don't , . ?"]
)
def test_round_trip_examples(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_tokens_never_split(tok, token):
    token_id = tok.convert_tokens_to_ids(token)
    assert tok.encode(token) == [token_id]
    ids = tok.encode(f"the{token}cat {token} {token}{token}")
    assert ids.count(token_id) == 4
    assert token in tok.all_special_tokens
    assert tok.decode(ids, skip_special_tokens=True) == "thecat  "


def test_special_token_text_pieces_are_not_special(tok):
    """Fragments of a special token are ordinary text."""
    ids = tok.encode("<|im_end")
    assert tok.convert_tokens_to_ids(IM_END) not in ids
    assert tok.decode(ids) == "<|im_end"


def test_save_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = f"the cat{MEDIA_PAD}{MEDIA_PAD} sees 世界{IM_END}{DOC_EOS}"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text)) == text
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (BOS, IM_END, PAD)
    assert loaded.image_token == MEDIA_PAD and loaded.video_token == VIDEO_PLACEHOLDER
    assert loaded.chat_template == CHAT_TEMPLATE
    assert len(loaded) == len(tok)
    assert set(SPECIAL_TOKENS) <= set(loaded.all_special_tokens)


# --- chat template -----------------------------------------------------------------------------------------------------
IMG = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"


def test_template_has_no_newlines():
    assert "\n" not in CHAT_TEMPLATE
    for token in (IM_END, MEDIA_PAD, VIDEO_PLACEHOLDER):
        assert token in CHAT_TEMPLATE


def test_text_only(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    expected = "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>4<|im_end|>"
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    assert render_chat(messages) == expected


def test_text_parts(tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}]
    assert render_chat(messages) == "<|im_user|>user<|im_middle|>a b<|im_end|>"


def test_image_and_text():
    messages = [{"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "Describe."}]}]
    assert render_chat(messages) == f"<|im_user|>user<|im_middle|>{IMG}Describe.<|im_end|>"


def test_two_images_in_order():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First:"},
                {"type": "image", "path": "a.png"},
                {"type": "text", "text": "second:"},
                {"type": "image", "image": "b.png"},
                {"type": "text", "text": "same?"},
            ],
        }
    ]
    assert render_chat(messages) == f"<|im_user|>user<|im_middle|>First:{IMG}second:{IMG}same?<|im_end|>"


def test_video_part():
    messages = [{"role": "user", "content": [{"type": "video", "path": "v.mp4"}, {"type": "text", "text": "Code it."}]}]
    assert render_chat(messages) == f"<|im_user|>user<|im_middle|>{VIDEO_PLACEHOLDER}Code it.<|im_end|>"


def test_system_message_and_generation_prompt(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = f"<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>{GEN}"
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert render_chat(messages, add_generation_prompt=True) == expected


def test_default_system_prompt_is_opt_in():
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(messages) == "<|im_user|>user<|im_middle|>Hi<|im_end|>"
    with_default = render_chat(messages, default_system_prompt=KIMI_DEFAULT_SYSTEM_PROMPT)
    assert with_default == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
    )
    # an explicit system message wins over the default
    explicit = [{"role": "system", "content": "S"}, *messages]
    assert render_chat(explicit, default_system_prompt="D").startswith("<|im_system|>system<|im_middle|>S<|im_end|>")


def test_none_content_renders_as_apply_chat_template_does(tok):
    """transformers drops keys whose value is None (`content: None` is an empty content); `render_chat` (which the
    data layer's `encode_chat` / `encode_prompt` use) renders such a message the same way."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    assert render_chat(messages) == tok.apply_chat_template(messages, tokenize=False) == (
        f"<|im_user|>user<|im_middle|>Hi{IM_END}{GEN}{IM_END}")


def test_multi_turn_and_tool():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "tool", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    assert render_chat(messages) == (
        "<|im_user|>user<|im_middle|>a<|im_end|><|im_assistant|>assistant<|im_middle|>b<|im_end|>"
        "<|im_system|>tool<|im_middle|>c<|im_end|><|im_user|>user<|im_middle|>d<|im_end|>"
    )


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "narrator", "content": "x"}], "Unsupported role narrator"),
        ([{"role": "user", "content": [{"type": "audio", "path": "a.wav"}]}], "Unsupported content part type audio"),
    ],
)
def test_template_errors(messages, match):
    with pytest.raises(Exception, match=match):
        render_chat(messages)


def test_assistant_mask(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "the cat"}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    masked = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(masked) == "the cat<|im_end|>"


def test_assistant_mask_leaves_out_assistant_media(tok):
    """An image or video in an assistant turn is input, as in the SFT stage (`encode_chat`): the mask holds the
    turn's text and its `<|im_end|>`, not the media block (nor a video's placeholder)."""
    reply = [{"type": "text", "text": "the cat"}, {"type": "image", "url": "x.png"}, "a dog",
             {"type": "video", "path": "v.mp4"}, {"type": "text", "text": "."}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "the cata dog.<|im_end|>"
    assert render_chat(messages).endswith(f"the cat{IMG}a dog{VIDEO_PLACEHOLDER}.{IM_END}")


@pytest.mark.parametrize(
    "assistant, match",
    [
        ({"content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
         "tool_calls are not supported"),
        ({"content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
         "tool_calls are not supported"),
        ({"content": "4", "reasoning_content": "2 + 2 = 4"}, "reasoning_content is not supported"),
    ],
)
def test_what_the_format_cannot_hold_is_refused_not_dropped(tok, assistant, match):
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", **assistant}]
    with pytest.raises(Exception, match=match):
        tok.apply_chat_template(messages, tokenize=False)
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    with pytest.raises(Exception, match="tools are not supported"):
        tok.apply_chat_template(messages[:1], tools=tools, tokenize=False)
    # empty or absent fields are fine
    plain = [messages[0], {"role": "assistant", "content": "4", "tool_calls": [], "reasoning_content": None}]
    assert tok.apply_chat_template(plain, tokenize=False, tools=None).endswith(f"4{IM_END}")


def test_documents_are_refused_not_dropped(tok):
    messages = [{"role": "user", "content": "What colour is the cat?"}]
    documents = [{"title": "Cats", "text": "The cat is red."}]
    with pytest.raises(Exception, match="documents are not supported"):
        tok.apply_chat_template(messages, documents=documents, tokenize=False)
    assert tok.apply_chat_template(messages, documents=[], tokenize=False) == render_chat(messages)
