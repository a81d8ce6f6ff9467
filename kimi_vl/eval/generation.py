"""Batched greedy generation for evaluation: Kimi-VL models and any transformers `AutoModelForCausalLM` /
`AutoModelForImageTextToText` with its tokenizer / processor.

`Engine.from_pretrained(dir)` picks the model class from the checkpoint's config (image-text-to-text when the
config is registered for `AutoModelForImageTextToText`, else causal LM; importing `kimi_vl` registers ours), and
the processor (vision models) or tokenizer (text models). `Engine.generate` takes a batch of `GenerationRequest`:
a raw prompt (`chat=False`, tokenized as is, with the tokenizer's own special tokens such as BOS; an image's
placeholder, `Engine.image_prompt`, goes first) or a user turn (`chat=True`, rendered with the chat template, image
part first when there is an image), left-pads them, decodes
greedily up to `max_new_tokens`, stops a row at an end-of-sequence id or a stop string, and returns the new text
(without the stop string, special tokens skipped).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.encode import end_token_ids, tokenizer_of
from ..errors import CheckpointError, ConfigError, hub_id_hint
from ..progress import transformers_bars
from ..tokenization.chat_template import IMAGE_PROMPT
from ..tokenization.special_tokens import IM_MIDDLE, MEDIA_PAD


@dataclass
class GenerationRequest:
    """One prompt: `text` is the whole raw prompt (`chat=False`) or the user's message (`chat=True`)."""

    text: str
    chat: bool = False
    image: Any = None  # a PIL image, or None


class StopOnStrings:
    """Stopping criterion: a row is done once its new text contains one of `stops` (checked on a window of the
    last tokens, so each step costs O(window); a stop string may span several tokens). Returns `[batch]` bools."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int, window: int = 32) -> None:
        self.tokenizer, self.stops, self.prompt_len, self.window = tokenizer, tuple(stops), prompt_len, window
        self.done: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        hit = torch.tensor([any(s in t for s in self.stops) for t in tails], device=input_ids.device)
        self.done = self.done | hit
        return self.done


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]


def first_line(text: str) -> str:
    """The first non-empty line of `text`, stripped (a local extractor model's answer)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the model's and the tokenizer's eos ids, and for Kimi tokenizers
    `<|im_end|>` (the end of a chat turn) and `[EOS]` (the end of a raw document)."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)
    if IM_MIDDLE in tokenizer.get_vocab():
        ids += [i for i in end_token_ids(tokenizer) if i not in ids]
    return ids


def resolve_device(device: str | torch.device | None) -> str:
    """The device to run on: `device` checked (a torch device this machine has), or cuda when available, else cpu.
    One check for every command that takes `--device` (`kimi-vl eval`, `kimi-vl demo video2web`).

    Raises:
        ConfigError: `device` is not a torch device, or this machine does not have it (no CUDA, no such GPU).
    """
    if device is None or device == "":
        return "cuda" if torch.cuda.is_available() else "cpu"
    text = str(device).strip()
    try:
        kind = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {text} is not a torch device (cpu, cuda, cuda:N, mps).") from None
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {text}: CUDA is not available on this machine; use --device cpu.")
        count = torch.cuda.device_count()
        if kind.index is not None and kind.index >= count:
            raise ConfigError(f"--device {text}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                              f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); pick one of them.")
    elif kind.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"--device {text}: MPS is not available on this machine; use --device cpu.")
    elif kind.type != "cpu":
        backend = getattr(torch, kind.type, None)
        if backend is None or not callable(getattr(backend, "is_available", None)) or not backend.is_available():
            raise ConfigError(f"--device {text}: {kind.type} is not available on this machine; use --device cpu.")
    return text


@dataclass
class Engine:
    """A model ready for batched greedy generation (see the module docstring).

    Built by `from_pretrained`, or directly from an in-memory model and its tokenizer (and processor, for images)
    to evaluate a model during training: generation runs in eval mode and restores the model's mode and the
    tokenizer's padding side afterwards (a tokenizer without a pad token gets its eos token as pad token).
    `weights` is the `weights_fingerprint` of the folder it was loaded from (None for an in-memory model or a folder
    without `*.safetensors`): the evaluation runner keys its response cache on it, else on `name`.
    """

    model: Any
    tokenizer: Any
    processor: Any = None
    name: str = "model"
    notes: list[str] = field(default_factory=list)
    weights: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        tok = self.tokenizer
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ConfigError(
                    f"the tokenizer of {self.name} has neither a pad nor an eos token; set tokenizer.pad_token."
                )
            tok.pad_token = tok.eos_token
        self.eos_token_ids = eos_token_ids(self.model, tok)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        *,
        device: str | None = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        progress: bool = True,
    ) -> Engine:
        """Load a saved model directory (our models or any transformers causal / image-text-to-text model).

        Args:
            device: `"cuda"`, `"cpu"`, ...; default CUDA when available (checked by `resolve_device`).
            dtype: `"auto"` (bfloat16 on CUDA, float32 on CPU), `"float32"`, `"bfloat16"` or `"float16"`.
            progress: transformers' loading bar (`kimi_vl.progress.transformers_bars`).

        Raises:
            CheckpointError: not a model directory, or the model / tokenizer cannot be loaded.
            ConfigError: a device this machine does not have (`resolve_device`), or a bad dtype.
        """
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

        import kimi_vl  # noqa: F401 - registers the Kimi-VL Auto classes

        from ..training.stages import weights_fingerprint

        path = Path(model_dir)
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"{str(path)!r} is a file, not a model directory; pass the folder written by "
                                  "save_pretrained or a training stage (the one holding config.json, the weights and "
                                  "the tokenizer / processor files).")
        if not path.is_dir():
            raise CheckpointError(f"model directory {str(path)!r} does not exist; pass a folder written by "
                                  "save_pretrained or a training stage." + hub_id_hint(path))
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} is not a saved model directory (no config.json); pass the folder written by "
                "save_pretrained (model weights + config + tokenizer/processor files)."
            )
        device = resolve_device(device)
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        elif dtype in ("float32", "bfloat16", "float16"):
            torch_dtype = getattr(torch, dtype)
        else:
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}.")
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            vision = type(config) in AutoModelForImageTextToText._model_mapping or any(
                "ImageTextToText" in k for k in (getattr(config, "auto_map", None) or {})
            )
            auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            with transformers_bars(progress):
                model = auto.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
            processor = None
            if vision:
                processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
                tokenizer = tokenizer_of(processor)
            else:
                tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"could not load {path} as a transformers model with its tokenizer / processor: {exc}. Check that the "
                "directory holds config.json, the weights and the tokenizer files (pass --trust-remote-code for "
                "remote-code models)."
            ) from exc
        model.to(device)
        return cls(model=model, tokenizer=tokenizer, processor=processor, name=str(path),
                   weights=weights_fingerprint(path))

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def supports_images(self) -> bool:
        """Whether the engine has an image processor (images are passed); text-only models see the text alone."""
        return self.processor is not None and getattr(self.processor, "image_processor", None) is not None

    @property
    def has_chat_template(self) -> bool:
        owner = self.processor if self.processor is not None else self.tokenizer
        return bool(getattr(owner, "chat_template", None) or getattr(self.tokenizer, "chat_template", None))

    def max_length(self, default: int) -> int:
        """The model's context length from its config (`max_position_embeddings`), else `default`."""
        config = getattr(self.model, "config", None)
        for c in (config, getattr(config, "text_config", None)):
            value = getattr(c, "max_position_embeddings", None)
            if isinstance(value, int) and value > 0:
                return min(default, value)
        return default

    def info(self) -> dict[str, Any]:
        """What was evaluated, for reports."""
        return {
            "name": self.name,
            "class": type(self.model).__name__,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "images": self.supports_images,
            "chat_template": self.has_chat_template,
            "weights": self.weights,
        }

    # ------------------------------------------------------------------ prompts
    @property
    def image_prompt(self) -> str:
        """What stands for one image in a raw prompt: for Kimi-VL the media block its chat template writes for an
        image part, else the processor's `image_token` (e.g. `<image>`).

        Raises:
            ConfigError: the processor names no image token (give the image through the chat template instead).
        """
        token = getattr(self.processor, "image_token", None)
        if token == MEDIA_PAD:
            return IMAGE_PROMPT
        if isinstance(token, str) and token:
            return token
        raise ConfigError(f"the processor of {self.name} names no image token, so an image cannot be placed in a raw "
                          "prompt; use the chat format (--mathvista-format chat).")

    def render(self, request: GenerationRequest) -> str:
        """The prompt text the model sees (before placeholder expansion)."""
        if not request.chat or not self.has_chat_template:
            if request.image is not None and self.supports_images:
                return self.image_prompt + request.text
            return request.text
        if request.image is not None and self.supports_images:
            content: Any = [{"type": "image"}, {"type": "text", "text": request.text}]
        else:
            content = request.text
        owner = self.processor if self.processor is not None else self.tokenizer
        messages = [{"role": "user", "content": content}]
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def count_tokens(self, text: str) -> int:
        """Tokens of a raw prompt (with the tokenizer's own special tokens)."""
        return len(self.tokenizer(text)["input_ids"])

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self, requests: Sequence[GenerationRequest], *, max_new_tokens: int, stop: Sequence[str] = ()
    ) -> list[str]:
        """Greedy continuations of one batch of requests (left-padded), new text only. A batch mixing raw and chat
        prompts runs as one batch of each: raw prompts get the tokenizer's special tokens (BOS), rendered chats
        already hold theirs, and one tokenizer call adds them to all its texts or to none."""
        from transformers import GenerationConfig, StoppingCriteriaList

        if not requests:
            return []
        is_chat = [r.chat and self.has_chat_template for r in requests]
        if len(set(is_chat)) > 1:
            outputs = {
                kind: iter(self.generate([r for r, c in zip(requests, is_chat) if c == kind],
                                         max_new_tokens=max_new_tokens, stop=stop))
                for kind in (False, True)
            }
            return [next(outputs[c]) for c in is_chat]
        texts = [self.render(r) for r in requests]
        chat = is_chat[0]
        images = [r.image for r in requests if r.image is not None] if self.supports_images else []
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"  # restored below: may be shared
        try:
            if images:
                inputs = self.processor(text=texts, images=images, padding=True, return_tensors="pt",
                                        add_special_tokens=not chat)
            else:
                inputs = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=not chat)
        finally:
            self.tokenizer.padding_side = side
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        prompt_len = inputs["input_ids"].shape[1]
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
            eos_token_id=self.eos_token_ids or None, pad_token_id=self.tokenizer.pad_token_id,
        )
        criteria = StoppingCriteriaList([StopOnStrings(self.tokenizer, stop, prompt_len)] if stop else [])
        training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(**inputs, generation_config=config, stopping_criteria=criteria)
        finally:
            self.model.train(training)
        results = []
        for row in out[:, prompt_len:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos_token_ids), len(row))
            text = self.tokenizer.decode(row[:end], skip_special_tokens=True)
            results.append(cut_at_stop(text, stop))
        return results

    def as_extractor(self, *, max_new_tokens: int = 64, batch: dict[str, str] | None = None) -> Callable[[str], str]:
        """A `prompt -> text` callable (the MathVista LLM extractor): greedy, through the chat template when there
        is one, first line of the answer. With `batch`, answers are looked up there first (precomputed)."""

        def extract(prompt: str) -> str:
            if batch is not None and prompt in batch:
                return batch[prompt]
            return first_line(self.generate([GenerationRequest(prompt, chat=True)], max_new_tokens=max_new_tokens)[0])

        return extract


__all__ = ["Engine", "GenerationRequest", "cut_at_stop", "first_line", "resolve_device"]
