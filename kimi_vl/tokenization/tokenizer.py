"""`build_tokenizer`: a byte-level BPE tokenizer trained from text with the `tokenizers`
library, wrapped as a transformers fast tokenizer with Kimi's chat template attached.

Byte-level: the pre-tokenizer maps every UTF-8 byte to one of 256 printable symbols before the GPT-2 split regex,
and the decoder maps them back, so any text (any unicode, control characters, whitespace runs) round-trips exactly:
`tok.decode(tok.encode(text)) == text`. There is no normaliser, no unknown token and no tokenization-space
clean-up. The special tokens below are added tokens marked `special`: they are matched whole before the BPE model
sees the text (never split, one id each) and are dropped by `decode(..., skip_special_tokens=True)`.

Ids: the special tokens come first, in the order of `SPECIAL_TOKENS` (ids `0 .. len(SPECIAL_TOKENS) - 1`), then
the 256 byte symbols, then the learned merges. `vocab_size` counts all of them.

Token roles (`bos_token`, `eos_token`, `pad_token`):
- `bos_token = "[BOS]"`, marks the start of a pre-training document. Nothing adds it automatically (no
  post-processor template, as with Kimi's tiktoken tokenizer; the chat template does not use it either).
- `eos_token = "<|im_end|>"`: chat generation stops at the end of the assistant turn, which is what
  `generate(...)` needs by default (Kimi recommends stopping on `<|im_end|>`). `[EOS]` (`DOC_EOS`) remains a
  special token for the end of a raw pre-training document; add it to `generation_config.eos_token_id` as well
  when sampling continuations of raw text.
- `pad_token = "[PAD]"`. Like every special token, the string "[PAD]" in text is read as the token; pass
  `split_special_tokens=True` to keep special-token strings text (`apply_chat_template(..., tokenize=True,
  sanitize_control_tokens=True)` does so for the messages).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ..errors import ConfigError
from .chat_template import CHAT_TEMPLATE
from .special_tokens import BOS, IM_END, MEDIA_PAD, PAD, SPECIAL_TOKENS, VIDEO_PLACEHOLDER

BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
"""Smallest `vocab_size` `build_tokenizer` accepts: the byte alphabet plus the special tokens (no merges)."""


def _checked_texts(texts: Iterable[str], seen: list[int]) -> Iterator[str]:
    """Yield `texts`, refusing non-strings and counting the non-empty ones in `seen[0]`."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"texts[{i}] is a {type(text).__name__}, not a str; pass an iterable of strings.")
        if text:
            seen[0] += 1
            yield text


def build_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and return it as a transformers fast tokenizer.

    Args:
        texts: training text (any iterable of strings, consumed once; a generator is fine).
        vocab_size: total vocabulary size including the 256 byte symbols and the `SPECIAL_TOKENS`; at least
            `MIN_VOCAB_SIZE`. Training stops earlier when no pair reaches `min_frequency`, so the result may be
            smaller (`len(tokenizer)` is the actual size).
        min_frequency: a pair is merged only if it occurs at least this many times.

    Returns:
        A `PreTrainedTokenizerFast` padding on the left, with `bos_token="[BOS]"`, `eos_token="<|im_end|>"`,
        `pad_token="[PAD]"`,
        `image_token` / `video_token` set to `MEDIA_PAD` / `VIDEO_PLACEHOLDER`, and Kimi's chat template
        (`kimi_vl.tokenization.chat_template.CHAT_TEMPLATE`). It saves and loads with `save_pretrained` /
        `from_pretrained` (or `AutoTokenizer.from_pretrained`).

    Raises:
        ConfigError: `vocab_size` below `MIN_VOCAB_SIZE`, `min_frequency < 1`, an item of `texts` that is not a
            string, or no non-empty text at all.
    """
    if isinstance(texts, str):
        raise ConfigError("texts must be an iterable of strings, not one string; wrap it in a list.")
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs the {BYTE_ALPHABET_SIZE} byte symbols plus "
            f"{len(SPECIAL_TOKENS)} special tokens = {MIN_VOCAB_SIZE} ids before any merge; pass at least "
            f"{MIN_VOCAB_SIZE}."
        )
    if min_frequency < 1:
        raise ConfigError(f"min_frequency must be at least 1, got {min_frequency}.")

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = [0]
    backend.train_from_iterator(_checked_texts(texts, seen), trainer=trainer)
    if seen[0] == 0:
        raise ConfigError("texts is empty (or holds only empty strings); pass some training text.")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        image_token=MEDIA_PAD,
        video_token=VIDEO_PLACEHOLDER,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, IM_END, PAD)],
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        padding_side="left",  # a batch of prompts for `generate` (right padding would continue after the pads)
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    missing = [t for t in SPECIAL_TOKENS if tokenizer.convert_tokens_to_ids(t) != SPECIAL_TOKENS.index(t)]
    if missing:  # pragma: no cover - a tokenizers behaviour change would land here
        raise ConfigError(f"special tokens {missing} did not get their reserved ids; report this as a bug.")
    return tokenizer


__all__ = ["BYTE_ALPHABET_SIZE", "MIN_VOCAB_SIZE", "build_tokenizer"]
