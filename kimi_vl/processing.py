"""`KimiVLProcessor`: tokenizer + MoonViT image and video processors + Kimi's chat template.

Placeholder expansion: each `<|media_pad|>` of the text stands for the next image and each
`<|kimi_k25_video_placeholder|>` for the next video, expanded by `kimi_vl.fusion.placeholders` into one placeholder
id per merged vision token (videos: a timestamped media block per temporal chunk), in the order of the vision
features the model writes over them (`kimi_vl.fusion.embedding`). `KimiVLConfig.image_token_id` / `video_token_id`
must be the tokenizer's ids of these two tokens.

Images and videos count over the whole batch: the number of `<|media_pad|>` in the (unexpanded) texts must equal the
number of images, and the number of video placeholders the number of videos; otherwise `InvalidMediaError` names
both counts. Outputs use transformers' key names: `input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw`,
`pixel_values_videos`, `video_grid_thw` (one row per temporal chunk).

Media are read with `kimi_vl.vision.load_image` / `load_video` (through the image and video processors): local
paths, `file://` URLs, PIL images, numpy arrays, decoded video frames, and videos given as their frames' image files
(`videos=[[[f0, f1, ...]]]`, transformers' nesting; what a chat template's `{"type": "video", "video": [f0, f1, ...]}`
becomes); never the network.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature
from transformers.processing_utils import MultiModalData, ProcessorMixin
from transformers.utils import logging
from transformers.video_utils import is_batched_video, make_batched_videos

from .errors import ConfigError, InvalidMediaError
from .fusion.placeholders import frame_times, image_placeholders, video_placeholders
from .tokenization.chat_template import CHAT_TEMPLATE
from .tokenization.special_tokens import (
    DOC_EOS,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    MEDIA_START,
    VIDEO_PLACEHOLDER,
)
from .vision.video_processing import fspath_videos, read_frame_lists

logger = logging.get_logger(__name__)


def _count_images(images: Any) -> int:
    """Number of images in one image or a (nested) list of them; a 4-D array / tensor is a batch of images."""
    if images is None:
        return 0
    if isinstance(images, (list, tuple)):
        return sum(_count_images(x) for x in images)
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        return int(images.shape[0])
    return 1


def _drop_empty(videos: Any) -> Any:
    """A batch of per-conversation video lists without the empty ones (None when nothing is left)."""
    if videos is None:
        return None
    if isinstance(videos, (list, tuple)):
        kept = [v for v in videos if not (isinstance(v, (list, tuple)) and len(v) == 0)]
        return kept or None
    return videos


def _count_videos(videos: Any) -> int:
    videos = _drop_empty(videos)
    return 0 if videos is None else len(make_batched_videos(videos))


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "a list of " + ", ".join(sorted({type(x).__name__ for x in value})) if value else "an empty list"
    return f"of type {type(value).__name__}"


def _check_media_per_sample(samples: list[str], media: Any, token: str, name: str, count: Callable[[Any], int]) -> None:
    """With one media list per text (`images=[[...], [...]]`, `videos=[[...], [...]]`), each text's placeholders
    (`token`) must match its own list, counted by `count`: the media are otherwise handed out in order across the
    batch, to whichever text's placeholders come next. A batch of videos given as frame lists (`[[frame, ...], ...]`)
    is not one list per text."""
    if not (isinstance(media, (list, tuple)) and media and all(isinstance(x, (list, tuple)) for x in media)):
        return
    if name == "video" and is_batched_video(media):
        return
    if len(media) != len(samples):
        raise InvalidMediaError(f"{name}s holds {len(media)} per-text lists for {len(samples)} texts; give one list "
                                f"per text, in order (an empty list for a text without {name}s).")
    for i, (sample, own) in enumerate(zip(samples, media)):
        if sample.count(token) != count(own):
            raise InvalidMediaError(
                f"text {i} holds {sample.count(token)} {name} placeholder(s) ({token}) but its {name} list has "
                f"{count(own)}; give each text exactly its own {name}s, one per placeholder, in order.")


def _base64_as_data_uri(messages: list) -> list:
    """`messages` with every image part's bare `base64` payload written as a `data:` URI (which `load_image` reads;
    transformers hands the payload over as is); the caller's dicts are left untouched."""

    def part(p: Any) -> Any:
        bare = (isinstance(p, dict) and p.get("type") == "image" and isinstance(p.get("base64"), str)
                and not p["base64"].startswith("data:"))
        return {**p, "base64": f"data:image/*;base64,{p['base64']}"} if bare else p

    return [{**m, "content": [part(p) for p in m["content"]]}
            if isinstance(m, dict) and isinstance(m.get("content"), (list, tuple)) else m for m in messages]


class KimiVLProcessor(ProcessorMixin):
    """Prepares Kimi-VL model inputs: chat template, media placeholder expansion, tokenization, image and video
    preprocessing (see the module docstring for the expansion rule and the output keys).

    Args:
        image_processor: a `MoonViTImageProcessor`.
        tokenizer: a fast tokenizer holding Kimi's special tokens (e.g. from `kimi_vl.tokenization.build_tokenizer`).
        video_processor: a `MoonViTVideoProcessor`.
        chat_template: Jinja chat template; defaults to the tokenizer's, else `kimi_vl.tokenization.CHAT_TEMPLATE`.
    """

    videos_kwargs = {"return_metadata": True}  # the timestamps of video chunks come from the metadata

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        video_processor: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        if chat_template is None:
            chat_template = getattr(tokenizer, "chat_template", None) or CHAT_TEMPLATE
        super().__init__(image_processor, tokenizer, video_processor, chat_template=chat_template, **kwargs)
        self.image_token = MEDIA_PAD
        self.video_token = VIDEO_PLACEHOLDER
        vocab = tokenizer.get_vocab()
        missing = [t for t in (MEDIA_PAD, VIDEO_PLACEHOLDER, MEDIA_START, MEDIA_CONTENT, MEDIA_END) if t not in vocab]
        if missing:
            raise ConfigError(
                f"the tokenizer lacks Kimi's media tokens {missing}; build it with "
                "kimi_vl.tokenization.build_tokenizer or add them as special tokens."
            )
        self.image_token_id = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PLACEHOLDER)

    # ------------------------------------------------------------------ inputs
    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        """Placeholder counts must match the media counts (`InvalidMediaError` naming both), then transformers'
        own checks."""
        if text is not None:
            samples = [text] if isinstance(text, str) else text
            if isinstance(samples, (list, tuple)) and all(isinstance(s, str) for s in samples):
                for name, token, count in (
                    ("image", self.image_token, _count_images(images)),
                    ("video", self.video_token, _count_videos(videos)),
                ):
                    placeholders = sum(s.count(token) for s in samples)
                    if placeholders != count:
                        raise InvalidMediaError(
                            f"the text holds {placeholders} {name} placeholder(s) ({token}) but {count} {name}(s) "
                            f"were passed; give exactly one {name} per placeholder, in order (the chat template "
                            f"writes one per {name} part)."
                        )
                _check_media_per_sample(samples, images, self.image_token, "image", _count_images)
        super().validate_inputs(images=images, text=text, videos=videos, audio=audio, **kwargs)

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs) -> BatchFeature:
        """Process `text` (str or list of str, with unexpanded placeholders), `images` and `videos`.

        Returns a `BatchFeature` with `input_ids`, `attention_mask` and, when media are given, `pixel_values`,
        `image_grid_thw`, `pixel_values_videos`, `video_grid_thw` (plus `video_metadata` with
        `return_metadata=True`). Tokenizer options (`padding`, `return_tensors`, ...) and image / video processor
        options (`max_patches`, `fps`, `num_frames`, ...) may be passed as keywords.
        """
        if text is not None and not (isinstance(text, str) or (
                isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text))):
            raise ConfigError(f"text must be a string or a non-empty list of strings, got {_describe(text)}.")
        if audio is not None:
            raise InvalidMediaError("Kimi-VL reads text, images and videos, not audio; leave audio out.")
        # before counting: `os.PathLike` files as `str`, and a video given as its frames' image files read as one video
        videos = read_frame_lists(fspath_videos(videos))
        if text is not None:  # before the empty per-text video lists are dropped
            samples = [text] if isinstance(text, str) else text
            _check_media_per_sample(samples, videos, self.video_token, "video", _count_videos)
        if _count_images(images) == 0:
            images = None
        videos = _drop_empty(videos)
        return super().__call__(images=images, text=text, videos=videos, audio=audio, **kwargs)

    def apply_chat_template(self, conversation: Any, chat_template: str | None = None, **kwargs: Any) -> Any:
        """transformers' `apply_chat_template` (one conversation, a list of messages, or a batch of them), after
        checking that no conversation is empty and that no content part is audio."""
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        batch = conversation if batched else [conversation]
        for i, messages in enumerate(batch):
            if not isinstance(messages, (list, tuple)) or not messages:
                raise ConfigError(f"conversation {i} is {_describe(messages)}; pass a non-empty list of messages "
                                  "({'role': ..., 'content': ...}), or a list of such lists for a batch.")
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, (list, tuple)) and any(
                        isinstance(p, dict) and p.get("type") in ("audio", "input_audio") for p in content):
                    raise InvalidMediaError("Kimi-VL reads text, images and videos, not audio; remove the audio "
                                            f"part of conversation {i}.")
        batch = [_base64_as_data_uri(messages) for messages in batch]
        return super().apply_chat_template(batch if batched else batch[0], chat_template, **kwargs)

    def _process_videos(self, videos: Any, **kwargs: Any):
        # One flat list of videos (apply_chat_template nests them per conversation); file paths stay paths so the
        # video processor reads them with decord.
        return super()._process_videos(make_batched_videos(videos), **kwargs)

    # ------------------------------------------------------------------ placeholder expansion (kimi_vl.fusion)
    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
        merge = kwargs.get("merge_size") or self.image_processor.merge_size
        return image_placeholders(image_inputs["image_grid_thw"][image_idx], self.image_token, merge)

    def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs: Any) -> str:
        merge = kwargs.get("merge_size") or self.video_processor.merge_size
        chunk_len = kwargs.get("temporal_patch_size") or self.video_processor.temporal_patch_size
        counts = [int(c) for c in video_inputs["num_chunks_per_video"]]
        start = sum(counts[:video_idx])
        grids = torch.as_tensor(video_inputs["video_grid_thw"])[start : start + counts[video_idx]]
        times = frame_times(video_inputs.get("video_metadata"), video_idx, int(grids[:, 0].sum()))
        return video_placeholders(grids, times, self.video_token, merge, chunk_len)

    def _get_num_multimodal_tokens(self, image_sizes=None, video_sizes=None, **kwargs: Any) -> MultiModalData:
        """Placeholder counts for images of `(height, width)` and videos of `(num_frames, height, width)`."""
        merged = self._merge_kwargs(**kwargs)
        data = {}
        if image_sizes is not None:
            ik = merged["images_kwargs"]
            data["num_image_tokens"] = [self.image_processor.get_num_image_tokens(h, w, ik) for h, w in image_sizes]
            data["num_image_patches"] = [
                self.image_processor.get_number_of_image_patches(h, w, ik) for h, w in image_sizes
            ]
        if video_sizes is not None:
            vk = merged["videos_kwargs"]
            data["num_video_tokens"] = [
                self.video_processor.get_num_video_tokens(t, h, w, vk) for t, h, w in video_sizes
            ]
        return MultiModalData(**data)

    # ------------------------------------------------------------------ outputs
    @property
    def unused_input_names(self) -> list[str]:
        return ["num_chunks_per_video"]

    def post_process_image_text_to_text(
        self, generated_outputs: Any, skip_special_tokens: bool = True, **kwargs: Any
    ) -> str | list[str]:
        """The assistant's answer of each sequence, without the prompt and the template.

        For each sequence of ids (a `[batch, length]` or `[length]` tensor / array / list, or a list of `[length]`
        tensors / arrays, with or without the prompt): keep what follows the last `<|im_assistant|>...<|im_middle|>`
        header (everything when there is none) up to the first `<|im_end|>` or `[EOS]`, and decode it
        (`skip_special_tokens` drops remaining special tokens such as padding). A `[length]` input gives a `str`, a
        batch a `list[str]`.
        """
        ids = generated_outputs.tolist() if hasattr(generated_outputs, "tolist") else [
            x.tolist() if hasattr(x, "tolist") else x for x in generated_outputs]  # a list of 1-D tensors / arrays
        single = len(ids) == 0 or not isinstance(ids[0], (list, tuple))
        batch = [ids] if single else ids
        tok = self.tokenizer
        header, middle = tok.convert_tokens_to_ids(IM_ASSISTANT), tok.convert_tokens_to_ids(IM_MIDDLE)
        stops = {tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(DOC_EOS)}
        answers = []
        for seq in batch:
            seq = [int(t) for t in seq]
            starts = [i for i, t in enumerate(seq) if t == header]
            if starts:
                rest = seq[starts[-1] + 1 :]
                seq = rest[rest.index(middle) + 1 :] if middle in rest else rest
            end = next((i for i, t in enumerate(seq) if t in stops), len(seq))
            answers.append(tok.decode(seq[:end], skip_special_tokens=skip_special_tokens, **kwargs))
        return answers[0] if single else answers


__all__ = ["KimiVLProcessor"]
