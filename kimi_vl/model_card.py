"""The model card (`README.md`) of a published Kimi-VL checkpoint: the Hub's metadata (library, pipeline, tags), what
the model is (its architecture and weight count, read from `config.json` and the weights' headers, nothing
loaded), how to load and prompt it, and how it was trained (the `training_summary.json` a training stage writes).
`kimi-vl export` writes it unless the checkpoint has a `README.md` of its own."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from .convert import _Source
from .errors import CheckpointError

MIXERS = {"kda": "KDA", "mla": "MLA (NoPE)", "mla_rope": "RoPE-MLA"}

PRIVATE_SUMMARY_KEYS = frozenset({"from", "complete"})
"""Summary fields the card leaves out: a local path (`from`) and the stage's bookkeeping."""

REPOSITORY_ID = "ORG/NAME"
"""Where the card's code loads the model from: replace it with the Hub repository (or a local folder)."""


def parameter_count(model_dir: str | Path) -> int:
    """The number of weights in the checkpoint's `*.safetensors` files (sharded or not; parameters and saved
    buffers such as the routers' biases), from their headers."""
    weights = _Source(Path(model_dir))  # raises CheckpointError without safetensors files
    return sum(math.prod(weights.shape(key)) for key in weights.keys())


def _architecture(config: dict[str, Any], parameters: int) -> str:
    text, vision = config["text_config"], config["vision_config"]
    layers = Counter(text.get("layer_types") or [])
    mixers = " + ".join(f"{n} {MIXERS.get(kind, kind)}" for kind, n in layers.items())
    if text.get("num_experts"):
        shared = f", {text['num_shared_experts']} shared" if text.get("num_shared_experts") else ""
        dense = text.get("first_k_dense") or 0
        first = "" if not dense else "; layer 1 dense" if dense == 1 else f"; layers 1-{dense} dense"
        moe = f"MoE feed-forward ({text['num_experts']} experts, {text['num_experts_per_tok']} active{shared}{first})"
    else:
        moe = "dense feed-forward"
    residual = {"standard": "the standard residual", "attnres": "full Attention Residuals",
                "block_attnres": "Block Attention Residuals"}.get(text.get("residual"), text.get("residual"))
    backbone = "Kimi-Linear" if "kda" in layers else "DeepSeek-V3-style (Kimi K2)"  # e.g. a converted Kimi K2.5
    return (f"A Kimi-style early-fusion vision-language model of {parameters:,} weights: a MoonViT-3D "
            f"native-resolution encoder ({vision['num_hidden_layers']} layers, hidden size {vision['hidden_size']}, "
            f"{vision['patch_size']}-pixel patches, images and videos) feeding one {backbone} backbone "
            f"({text['num_hidden_layers']} layers: {mixers}; hidden size {text['hidden_size']}; {moe}; {residual}; "
            f"vocabulary {text['vocab_size']:,}).")


def _usage(repository: str) -> str:
    return f"""```python
from transformers import AutoModelForImageTextToText, AutoProcessor

model = AutoModelForImageTextToText.from_pretrained("{repository}", trust_remote_code=True)
processor = AutoProcessor.from_pretrained("{repository}", trust_remote_code=True)

messages = [{{"role": "user", "content": [{{"type": "image", "path": "photo.jpg"}},
                                         {{"type": "text", "text": "What is in the picture?"}}]}}]
inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=64)
print(processor.post_process_image_text_to_text(out[:, inputs["input_ids"].shape[1]:])[0])
```

Videos go in the same way (`{{"type": "video", "path": "clip.mp4"}}`). The model's code comes with it
(`trust_remote_code=True`: `modeling_kimi_vl.py` and the `kimi_vl_*.py` files); with the `kimi_vl` package
installed, `import kimi_vl` registers the same classes and `trust_remote_code` is not needed."""


def _training(summary: dict[str, Any]) -> str:
    rows = [f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |"
            for key, value in summary.items()
            if key not in PRIVATE_SUMMARY_KEYS and not isinstance(value, (dict, list))]
    return "\n".join(["| setting or figure | value |", "|---|---|", *rows])


def model_card(model_dir: str | Path, *, name: str | None = None, repository: str = REPOSITORY_ID,
               evaluation: str | None = None) -> str:
    """The `README.md` text for the saved Kimi-VL checkpoint `model_dir` (`config.json`, weights, and the
    `training_summary.json` of the stage that trained it, when there is one). `name`: the card's title (default: the
    folder's name); `repository`: the id the card's code loads from; `evaluation`: a Markdown section of the model's
    scores, placed after the training summary.

    Raises:
        CheckpointError: no `config.json` of model_type `kimi_vl`, or no safetensors weights.
    """
    from . import __version__  # the package's, defined once it is imported

    path = Path(model_dir)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} is missing or not JSON ({exc}); save the model first.") from exc
    if config.get("model_type") != "kimi_vl":
        raise CheckpointError(f"{path} holds a {config.get('model_type')!r} model, not 'kimi_vl'.")
    linear = "kda" in (config["text_config"].get("layer_types") or [])
    sections = [
        "---\nlibrary_name: transformers\npipeline_tag: image-text-to-text\ntags:\n- kimi-vl\n"
        + ("- kimi-linear\n" if linear else "") + "- moonvit\n- custom_code\n---",
        f"# {name or path.resolve().name}",
        _architecture(config, parameter_count(path)) + f" Published with kimi-vl {__version__}.",
        "## Use\n\n" + _usage(repository),
    ]
    summary_file = path / "training_summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
        sections.append(f"## Training\n\nThe last training stage's summary (`training_summary.json`):\n\n"
                        f"{_training(summary)}")
    if evaluation:
        sections.append(evaluation.strip())
    return "\n\n".join(sections) + "\n"


__all__ = ["REPOSITORY_ID", "model_card", "parameter_count"]
