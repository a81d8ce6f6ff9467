"""The embedded default data as packed streams: the standard library corpus and the synthetic world, needing no
download. `embedded_pretrain_stream` (joint text-vision pre-training at a constant vision ratio, with the optional
option-letter drill warm-up at its own ratio) and `embedded_sft_stream` (zero-vision SFT chats) are what every stage
trains on without `--data`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..tokenization.special_tokens import BOS, DOC_EOS, MEDIA_PAD, VIDEO_PLACEHOLDER
from .chats import sft_conversation
from .corpus import stdlib_window
from .encode import (
    IGNORE_INDEX,
    Document,
    encode_chat,
    encode_sample,
    plain_ids,
    special_ids,
    tokenizer_of,
)
from .pack import BatchDraws, PackedStream, WarmupStream
from .world import (
    CURRICULUM_TASKS,
    LETTERS,
    TEXT_TASKS,
    VIDEO_TASKS,
    VISION_TASKS,
    make_sample,
    option_lookup,
    options_block,
)


def stdlib_document(rng: random.Random, tokenizer: Any, num_chars: int) -> Document:
    """A splittable document from a random standard library excerpt of about `num_chars` characters: `[BOS]`
    excerpt, plus `[EOS]` when the excerpt reaches the end of its file."""
    text, at_end = stdlib_window(rng, num_chars)
    bos, eos = special_ids(tokenizer, (BOS, DOC_EOS))
    ids = [bos, *plain_ids(tokenizer, text)] + ([eos] if at_end else [])
    return Document(ids, [IGNORE_INDEX, *ids[1:]], splittable=True)


def _task_picker(tasks: tuple[str, ...], weights: dict[str, float] | None, name: str
                 ) -> Callable[[random.Random], str]:
    """`rng -> task`: uniform over `tasks` but the `CURRICULUM_TASKS` (`rng.choice`) when `weights` is None, else
    drawn with `weights` (tasks left out have weight 0)."""
    if weights is None:
        uniform = tuple(t for t in tasks if t not in CURRICULUM_TASKS)
        return lambda rng: rng.choice(uniform)
    unknown = sorted(set(weights) - set(tasks))
    if unknown or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ConfigError(f"{name} must map some of {', '.join(tasks)} to weights >= 0 with a positive sum; got "
                          f"{weights!r}.")
    names = [t for t in tasks if weights.get(t, 0) > 0]
    cumulative = list(itertools.accumulate(weights[t] for t in names))
    return lambda rng: rng.choices(names, cum_weights=cumulative)[0]


def option_drill_document(rng: random.Random, processor: Any, lookups: int = 3, min_options: int = 10,
                          max_options: int = 10, any_letters: bool = False) -> Document:
    """The option-letter drill in its barest form: the options of a world `mc` question (its first k, k drawn in
    `min_options .. max_options`: fewer options make an easier start), then `lookups` of them (distinct, random
    order) as "The option 42 is (C)." sentences, with the loss on the looked-up letters only (everything else is a
    random draw or a copy; the letter is the one thing to learn). With `any_letters` the k options are lettered by k
    of A-J drawn at random (in alphabetical order: `B. ...\nF. ...\nG. ...`), so every letter is a target from the
    first few-option question on and the letters' frequencies say nothing about the answer. Not splittable.

    `[BOS]Options:\nA. ...\nJ. ...\nThe option 42 is (C). The option red is (A). ...[EOS]`
    """
    if not 1 <= min_options <= max_options <= len(LETTERS):
        raise ConfigError(f"a drill question needs 1 <= min_options <= max_options <= {len(LETTERS)} options, got "
                          f"{min_options} and {max_options}.")
    tok = tokenizer_of(processor)
    bos, eos = special_ids(tok, (BOS, DOC_EOS))
    options = make_sample("mc", rng).choices or []
    if min_options < len(options):  # fewer options: an easier start for the drill
        options = options[: rng.randint(min_options, max_options)]
    letters = sorted(rng.sample(LETTERS, len(options))) if any_letters else LETTERS[: len(options)]
    picks = rng.sample(range(len(options)), min(lookups, len(options)))
    ids = [bos] + tok(options_block(options, letters) + "\n", add_special_tokens=False,
                      split_special_tokens=True)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    close = tok(").", add_special_tokens=False)["input_ids"]
    for k, i in enumerate(picks):
        sentence = option_lookup(options[i], letters[i])  # "The option 42 is (C).": the letter is the target
        query = tok(("" if k == 0 else " ") + sentence[: sentence.rindex("(") + 1], add_special_tokens=False,
                    split_special_tokens=True)["input_ids"]
        letter = tok(letters[i], add_special_tokens=False)["input_ids"]
        ids += query + letter + close
        labels += [IGNORE_INDEX] * len(query) + letter + [IGNORE_INDEX] * len(close)
    ids.append(eos)
    labels.append(IGNORE_INDEX)
    return Document(ids, labels)


DRILL_RAMP_OPTIONS: tuple[tuple[float, int, int], ...] = ((0.0, 2, 3), (0.5, 2, 6))
"""The drill's easy start: `(from this fraction of the ramp's batches on, fewest, most options)`."""


def drill_option_range(index: int, ramp_batches: int, min_options: int) -> tuple[int, int]:
    """Fewest and most options of the drill questions of batch `index`: 2-3 in the first half of the
    `ramp_batches` first batches, 2-6 in the second half, then `min_options`-10. With ten options from the start,
    when the lookup is learned varies from seed to seed (`tiny` preset: within the 450 drill batches on two seeds of
    four, not at all on the other two); started on 2-3 options it was learned on every seed tried on one machine but
    missed on 3 runs of 11 on another, until the options were lettered by any of A-J (`option_drill_document`'s
    `any_letters`); it carries over as the options grow (docs/RESULTS.md)."""
    if index < ramp_batches:
        return next((lo, hi) for start, lo, hi in reversed(DRILL_RAMP_OPTIONS) if index >= start * ramp_batches)
    return min_options, len(LETTERS)


def embedded_pretrain_stream(
    processor: Any,
    *,
    seq_len: int,
    rows: int,
    seed: int,
    vision_ratio: float = 0.25,
    video_fraction: float = 0.1,
    chat_fraction: float = 0.25,
    code_fraction: float = 0.5,
    text_chat_fraction: float = 0.0,
    text_tasks: dict[str, float] | None = None,
    vision_tasks: dict[str, float] | None = None,
    video_tasks: dict[str, float] | None = None,
    drill_batches: int = 0,
    drill_lookups: int = 5,
    drill_min_options: int = 3,
    drill_ramp_batches: int = 0,
    drill_any_letters: bool = False,
    drill_vision_tasks: dict[str, float] | None = None,
    drill_vision_ratio: float | None = None,
) -> PackedStream | WarmupStream:
    """The joint text-vision pre-training stream (embedded data only).

    Text documents: with probability `code_fraction` a standard library excerpt (about `4 * seq_len`
    characters), else a world text sample (`TEXT_TASKS`, drawn with the weights `text_tasks`, uniformly when
    None), in chat form with probability `text_chat_fraction` (loss on the reply; not splittable) else in
    pre-training form (splittable). Vision documents: a world sample with media: a video with
    probability `video_fraction` (`VIDEO_TASKS` with the weights `video_tasks`; when None, `screencast` only), else
    an image task (`VISION_TASKS`, weights `vision_tasks`, uniform when None),
    in chat form with probability `chat_fraction` (loss on the reply) else in pre-training form (loss on the text
    after the media). `vision_ratio` of every batch's tokens are vision tokens.

    With `drill_batches > 0` the stream is a `WarmupStream`: in its first `drill_batches` batches every text
    document is an option-letter drill (`option_drill_document` with `drill_lookups` lookups among
    `drill_min_options` to 10 options), and the vision documents are world tasks in chat form (loss on their short
    replies only; drawn with the weights `drill_vision_tasks`, default `vision_tasks`: a short-reply image
    curriculum, which may also name video tasks such as `page_color`; no screencasts unless named), at the vision
    ratio `drill_vision_ratio` (default: `vision_ratio`). Finding an option's letter from its value is the last
    step of every multiple-choice answer; in the mixture alone a tiny model does not learn it within the
    quickstart's minutes (its letters are a few tokens among many), after the drill it keeps the skill and applies
    it to the mixture's questions. In the first `drill_ramp_batches` batches the drill's questions have fewer
    options (`drill_option_range`); with `drill_any_letters` their options are lettered by any of A-J
    (`option_drill_document`).
    """
    for name, value in (("video_fraction", video_fraction), ("chat_fraction", chat_fraction),
                        ("code_fraction", code_fraction), ("text_chat_fraction", text_chat_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {value}.")
    pick_text = _task_picker(TEXT_TASKS, text_tasks, "text_tasks")
    pick_vision = _task_picker(VISION_TASKS, vision_tasks, "vision_tasks")
    pick_video = _task_picker(VIDEO_TASKS, video_tasks, "video_tasks")

    def text_doc(draws: BatchDraws) -> Document:
        rng = draws.rng
        if rng.random() < code_fraction:
            return stdlib_document(rng, processor, 4 * seq_len)
        sample = make_sample(pick_text(rng), rng)
        return encode_sample(sample, processor, chat=text_chat_fraction > 0 and rng.random() < text_chat_fraction)

    def vision_doc(draws: BatchDraws) -> Document:
        rng = draws.rng
        task = pick_video(rng) if rng.random() < video_fraction else pick_vision(rng)
        chat = rng.random() < chat_fraction
        return encode_sample(make_sample(task, rng), processor, chat=chat)

    main = PackedStream(text_doc, seq_len=seq_len, rows=rows, seed=seed, vision_ratio=vision_ratio,
                        vision_documents=vision_doc, processor=processor)
    if drill_batches < 0 or drill_lookups < 1 or drill_ramp_batches < 0:
        raise ConfigError(f"drill_batches and drill_ramp_batches must be >= 0 and drill_lookups >= 1, got "
                          f"{drill_batches}, {drill_ramp_batches}, {drill_lookups}.")
    if not drill_batches:
        return main

    pick_drill_vision = pick_vision if drill_vision_tasks is None else _task_picker(
        VISION_TASKS + VIDEO_TASKS, drill_vision_tasks, "drill_vision_tasks")

    def drill_vision_doc(draws: BatchDraws) -> Document:  # short replies: the letters keep their share of the loss
        return encode_sample(make_sample(pick_drill_vision(draws.rng), draws.rng), processor, chat=True)

    def drill_doc(draws: BatchDraws) -> Document:
        fewest, most = drill_option_range(draws.index, drill_ramp_batches, drill_min_options)
        return option_drill_document(draws.rng, processor, drill_lookups, fewest, most, drill_any_letters)

    drill = PackedStream(drill_doc,
                         seq_len=seq_len, rows=rows, seed=seed,
                         vision_ratio=vision_ratio if drill_vision_ratio is None else drill_vision_ratio,
                         vision_documents=drill_vision_doc, processor=processor, max_misses=6)
    return WarmupStream(drill, main, drill_batches)


def embedded_sft_stream(processor: Any, *, seq_len: int, rows: int, seed: int = 0, max_misses: int = 6
                        ) -> PackedStream:
    """The zero-vision SFT stream: text-only conversations (`chats.sft_conversation`) packed whole, loss on the
    assistant turns only. Never holds a media token (`ConfigError` if a conversation would). `max_misses`
    conversations may be drawn per row to fill its gap before the gap is padded."""
    image_id, video_id = special_ids(processor, (MEDIA_PAD, VIDEO_PLACEHOLDER))

    def chat_doc(draws: BatchDraws) -> Document:
        doc = encode_chat(sft_conversation(draws.rng), processor)
        if doc.media or image_id in doc.input_ids or video_id in doc.input_ids:
            raise ConfigError("a zero-vision SFT conversation produced media tokens; SFT data must be text only.")
        return doc

    return PackedStream(chat_doc, seq_len=seq_len, rows=rows, seed=seed, processor=processor, max_misses=max_misses)


__all__ = ["DRILL_RAMP_OPTIONS", "drill_option_range", "embedded_pretrain_stream", "embedded_sft_stream",
           "option_drill_document", "stdlib_document"]
