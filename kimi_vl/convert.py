"""Import released Hugging Face checkpoints into kimi-vl's own formats.

`convert_kimi_k25_vision` (MoonViT-3D + projector from a `kimi_k25` checkpoint) lives in
`kimi_vl.vision.convert` and is re-exported here.

`convert_kimi_k25` imports a whole transformers `kimi_k25` model (Kimi K2.5 / K2.6: MoonViT-3D + projector +
DeepSeek-V3-style text model) as a `KimiVLForConditionalGeneration` checkpoint, and `convert_deepseek_v3` a
`deepseek_v3` / `kimi_k2` text model as a `kimi_vl_text` one; see `convert_kimi_k25` for what is and is not imported.
Both stream: every output tensor is written part by part (one source tensor, or one expert of a stacked expert
tensor, at a time) into sharded safetensors, so converting a ~1T-parameter model needs about the memory of its
largest source tensor, never the model; they write into a temporary sibling of the destination and rename it into
place, so a failure leaves nothing at the destination.

`convert_kimi_linear` reads a `kimi_linear` checkpoint directory (the released Kimi-Linear format with
`block_sparse_moe.experts.{e}.w1/w2/w3` and per-projection convs, or transformers' native layout with packed
`conv1d`, `forget_gate.*` and `experts.gate_up_proj`; sharded or not) and writes a `kimi_vl_text` checkpoint
that `KimiTextForCausalLM.from_pretrained` loads. Tensors are streamed shard by shard, so converting needs
about one output shard of memory, not the whole model.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CheckpointError, ConfigError
from .progress import progress_bar
from .text.configuration import KimiTextConfig
from .vision.convert import (
    PROJECTOR_PREFIXES,
    VISION_PREFIXES,
    collect_vision_weights,
    convert_kimi_k25_vision,
    load_config_json,
    read_source_config,
    rope_deinterleave,
    safetensors_files,
    staged_directory,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from .configuration import KimiVLConfig
    from .modeling import KimiVLForConditionalGeneration
    from .vision.configuration import MoonViTConfig

__all__ = ["assemble_kimi_vl", "convert_deepseek_v3", "convert_kimi_k25", "convert_kimi_k25_vision",
           "convert_kimi_linear", "deepseek_v3_config_to_text_config", "kimi_linear_config_to_text_config"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tiktoken.model",
                   "generation_config.json", "chat_template.jinja")
DEFAULT_SHARD_BYTES = 4 * 1024**3


def kimi_linear_config_to_text_config(src: dict, **overrides) -> KimiTextConfig:
    """Map a `kimi_linear` config.json dict (released remote-code or transformers-native fields) to ours."""
    from transformers import KimiLinearConfig

    if src.get("model_type") != "kimi_linear":
        raise CheckpointError(f"config.json has model_type={src.get('model_type')!r}; expected 'kimi_linear'.")
    if src.get("mla_use_nope") is False:
        raise CheckpointError("This checkpoint applies RoPE in MLA (mla_use_nope=false); kimi-vl MLA is NoPE only.")
    if src.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"Unsupported router activation {src['moe_router_activation_func']!r} (need sigmoid).")
    fields = {k: v for k, v in src.items() if k not in ("architectures", "auto_map", "transformers_version")}
    ref = KimiLinearConfig(**fields)
    # MLA expands keys and values for every query head from the latent, whatever num_key_value_heads says (its
    # default, 32, stays in configs with fewer heads; transformers runs those as num_key_value_heads=num_heads).
    if ref.num_key_value_heads is not None and ref.num_key_value_heads < ref.num_attention_heads:
        raise CheckpointError(f"MLA with num_key_value_heads={ref.num_key_value_heads} < num_attention_heads="
                              f"{ref.num_attention_heads} is not a Kimi-Linear layout.")
    if ref.hidden_act != "silu":
        raise CheckpointError(f"hidden_act={ref.hidden_act!r}: kimi-vl's feed-forward and KDA short conv use silu "
                              "only.")
    dense = [t == "dense" for t in ref.mlp_layer_types]
    first_k_dense = dense.index(False) if False in dense else len(dense)
    if any(dense[first_k_dense:]):
        raise CheckpointError(f"Dense FFN layers must come first; got mlp_layer_types={ref.mlp_layer_types}.")
    kinds = {"linear_attention": "kda", "full_attention": "mla"}
    if any(t not in kinds for t in ref.layer_types):
        raise CheckpointError(f"Unknown layer types in {ref.layer_types}.")
    cfg = dict(
        shared_text_fields(ref),
        layer_types=[kinds[t] for t in ref.layer_types],
        kda_num_heads=ref.linear_num_heads,
        kda_head_dim=ref.linear_head_dim,
        short_conv_kernel_size=ref.linear_conv_kernel_dim,
        num_experts=ref.num_local_experts,
        num_experts_per_tok=ref.num_experts_per_tok,
        num_shared_experts=ref.n_shared_experts,
        norm_topk_prob=ref.norm_topk_prob,
        n_group=ref.n_group,
        topk_group=ref.topk_group,
        first_k_dense=first_k_dense,
    )
    cfg.update(overrides)
    return KimiTextConfig(**cfg)


SHARED_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "moe_intermediate_size", "routed_scaling_factor", "rms_norm_eps", "initializer_range",
                      "attention_bias", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")


def shared_text_fields(ref: PretrainedConfig) -> dict:
    """The `KimiTextConfig` fields that transformers' `kimi_linear` and `deepseek_v3` configs name as we do, read from
    `ref` (either config), plus the standard residual stream (exact parity; AttnRes is an override)."""
    return {**{name: getattr(ref, name) for name in SHARED_TEXT_FIELDS}, "residual": "standard"}


class _Source:
    """Lazy access to every tensor of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, src_dir: Path) -> None:
        self.handles = [safe_open(str(f), framework="pt") for f in safetensors_files(src_dir)]
        self.where = {key: h for h in self.handles for key in h.keys()}

    def keys(self) -> list[str]:
        return list(self.where)

    def get(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.where[key].get_slice(key).get_shape())

    def dtype_code(self, key: str) -> str:
        """The safetensors dtype of `key` as the file names it (`"BF16"`, `"F8_E4M3"`, `"I32"`, ...)."""
        return self.where[key].get_slice(key).get_dtype()

    def dtype(self, key: str) -> torch.dtype:
        code = self.dtype_code(key)
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key} has dtype {code}, which kimi-vl does not import.")
        return SAFETENSORS_DTYPES[code]

    def get_rows(self, key: str, index: int, start: int, stop: int) -> torch.Tensor:
        """`tensor[index, start:stop]` read without loading the rest of the tensor."""
        return self.where[key].get_slice(key)[index : index + 1, start:stop][0]


def _plan(keys: list[str], cfg: KimiTextConfig) -> dict[str, Callable[[_Source], torch.Tensor]]:
    """Target key -> function building that tensor from the source. Raises on any unused source key."""
    plan: dict[str, Callable[[_Source], torch.Tensor]] = {}
    used: set[str] = set()

    def take(key: str) -> Callable[[_Source], torch.Tensor]:
        used.add(key)
        return lambda s: s.get(key)

    def stack(keys_: list[str]) -> Callable[[_Source], torch.Tensor]:
        used.update(keys_)
        return lambda s: torch.stack([s.get(k) for k in keys_])

    def part(key: str, dim: int, index: int, parts: int) -> Callable[[_Source], torch.Tensor]:
        used.add(key)
        return lambda s: s.get(key).chunk(parts, dim=dim)[index].contiguous()

    present = set(keys)
    for key in keys:
        if key in used:
            continue
        new = key.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$", new)
        if m:
            prefix, _, w = m.groups()
            src_prefix = key[: key.index(".experts.") + len(".experts.")]
            members = [f"{src_prefix}{e}.{w}.weight" for e in range(cfg.num_experts)]
            missing = [k for k in members if k not in present]
            if missing:
                raise CheckpointError(f"Expert weights missing from the checkpoint, e.g. {missing[0]}.")
            plan[f"{prefix}.{w}"] = stack(members)
        elif new.endswith(".mlp.experts.gate_up_proj"):
            base = new[: -len("gate_up_proj")]
            plan[base + "w1"] = part(key, 1, 0, 2)
            plan[base + "w3"] = part(key, 1, 1, 2)
        elif new.endswith(".mlp.experts.down_proj"):
            plan[new[: -len("down_proj")] + "w2"] = take(key)
        elif new.endswith(".self_attn.conv1d.weight"):
            base = new[: -len("conv1d.weight")]
            for i, name in enumerate(("q", "k", "v")):
                plan[f"{base}{name}_conv1d.weight"] = part(key, 0, i, 3)
        else:
            plan[new] = take(key)
    unused = sorted(set(keys) - used)
    if unused:
        raise CheckpointError(f"Unrecognised tensors in the checkpoint: {unused[:5]}")
    return plan


def _check_against_model(plan: dict, cfg: KimiTextConfig) -> dict[str, tuple[int, ...]]:
    """Raise `CheckpointError` unless `plan` builds exactly the tensors of `KimiTextForCausalLM(cfg)`; return their
    shapes (target key -> shape)."""
    from .text import KimiTextForCausalLM

    with torch.device("meta"):
        model = KimiTextForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(plan))
    extra = sorted(set(plan) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"The checkpoint does not match its config: missing {missing[:5]}, unexpected {extra[:5]}."
        )
    return expected


def convert_kimi_linear(
    src_dir: str | Path, dst_dir: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
    **config_overrides
) -> Path:
    """Convert a transformers `kimi_linear` checkpoint directory into a `kimi_vl_text` one.

    `config_overrides` set fields of the new `KimiTextConfig` (e.g. `residual="block_attnres"`,
    `router_biased_weights=True` to reproduce the released remote code's router exactly). Each output shard is
    written as soon as it is full (memory: about one shard), into a temporary sibling of `dst_dir` renamed into
    place (`staged_directory`): an existing non-empty `dst_dir` is refused unless `overwrite` (then replaced whole,
    never mixing two checkpoints' files). Returns the destination directory.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    raw = load_config_json(src, ("kimi_linear",), "convert_kimi_linear", CONVERTERS)
    cfg = kimi_linear_config_to_text_config(raw, **config_overrides)
    source = _Source(src)
    _check_not_quantized(source, src)
    # transformers builds zero-width shared experts when n_shared_experts=0: they add nothing, ours has none
    keys = [k for k in source.keys() if ".shared_experts." not in k or math.prod(source.shape(k))]
    plan = _plan(keys, cfg)
    # transformers' KimiLinearForCausalLM never ties its head: a saved `lm_head.weight` is used whatever the config
    cfg.tie_word_embeddings = _tie("lm_head.weight" if "lm_head.weight" in plan else None, cfg.tie_word_embeddings,
                                   src, "model.embed_tokens.weight" in plan)
    shapes = _check_against_model(plan, cfg)

    with staged_directory(dst, overwrite, src) as tmp:
        shards: list[list[str]] = []  # the keys of each shard written
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            save_file(shard, str(tmp / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards.append(sorted(shard))
            shard.clear()

        for key in progress_bar(sorted(plan), desc="converting", unit="tensor"):
            t = plan[key](source)
            if tuple(t.shape) != shapes[key]:
                raise CheckpointError(f"{src}: {key} is {tuple(t.shape)} in the checkpoint but {shapes[key]} in the "
                                      "model its config.json describes; use the config.json that came with these "
                                      "weights.")
            nbytes = t.numel() * t.element_size()
            if size and size + nbytes > max_shard_bytes:
                flush()
                size = 0
            shard[key] = t
            size += nbytes
            total += nbytes
        flush()
        _name_shards(shards, tmp, total)
        cfg.architectures = ["KimiTextForCausalLM"]
        cfg.save_pretrained(tmp)
        _copy_tokenizer_files(src, tmp)
    return dst


def _name_shards(shards: list[list[str]], folder: Path, total_size: int) -> None:
    """Rename the `shard-{i}.safetensors` in `folder` (`shards[i]`: its keys) to `model.safetensors`, or to
    `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json` (`total_size`: the tensors' bytes)."""
    if len(shards) == 1:
        (folder / "shard-0.safetensors").rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"shard-{i}.safetensors").rename(folder / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def assemble_kimi_vl(
    vision_dir: str | Path,
    text: str | Path | KimiTextConfig,
    *,
    image_token_id: int,
    video_token_id: int,
) -> KimiVLForConditionalGeneration:
    """A `KimiVLForConditionalGeneration` from a converted MoonViT directory (`convert_kimi_k25_vision`: tower and
    projector) and a text backbone: a `kimi_vl_text` checkpoint directory (e.g. from `convert_kimi_linear`) or a
    `KimiTextConfig` for a freshly initialised one. Save the result with `save_pretrained`."""
    from .configuration import KimiVLConfig
    from .modeling import KimiVLForConditionalGeneration
    from .text import KimiTextForCausalLM
    from .vision import MoonViTModel, MoonViTProjector

    vision = MoonViTModel.from_pretrained(vision_dir)
    projector = MoonViTProjector.from_pretrained(vision_dir)
    language = None if isinstance(text, KimiTextConfig) else KimiTextForCausalLM.from_pretrained(text)
    text_config = text if language is None else language.config
    if projector.mlp.fc2.out_features != text_config.hidden_size:
        raise CheckpointError(
            f"the projector outputs {projector.mlp.fc2.out_features} features but the text model's hidden size is "
            f"{text_config.hidden_size}; pair the vision tower with the language model it was trained for."
        )
    config = KimiVLConfig(vision_config=vision.config, text_config=text_config, image_token_id=image_token_id,
                          video_token_id=video_token_id)
    model = KimiVLForConditionalGeneration(config)
    model.vision_tower.load_state_dict(vision.state_dict())
    model.multi_modal_projector.load_state_dict(projector.state_dict())
    if language is not None:
        model.language_model.load_state_dict(language.state_dict())
    return model


# --------------------------------------------------------------------------------------------------------------------
# Streaming writer: sharded safetensors written tensor part by tensor part.

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
QUANTIZED_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_packed", "weight_shape", "weight_zero_point",
                      "input_scale")


@dataclass
class TensorSpec:
    """One output tensor: its shape and dtype, and the parts that, concatenated along dim 0 in order, make it (a
    stacked expert tensor is one part per expert; most tensors are one part). Parts are produced one at a time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list[Callable[[], torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _write_safetensors(path: Path, specs: dict[str, TensorSpec], keys: list[str]) -> None:
    """A safetensors file holding `keys` of `specs`, written part by part (never the whole file in memory)."""
    header: dict[str, dict] = {}
    offset = 0
    for key in keys:
        spec = specs[key]
        header[key] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape),
                       "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key in keys:
            spec, written = specs[key], 0
            for part in spec.parts:
                t = part()
                if t.dtype != spec.dtype:
                    raise CheckpointError(f"{key}: its source tensors mix dtypes ({t.dtype} and {spec.dtype}).")
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(memoryview(data))
                written += data.nbytes
            if written != spec.nbytes:
                raise CheckpointError(f"{key}: its source tensors hold {written} bytes, expected {spec.nbytes} for "
                                      f"shape {spec.shape}.")


def write_streamed_shards(specs: dict[str, TensorSpec], dst: Path, max_shard_bytes: int,
                          desc: str = "converting") -> None:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` when the tensors
    exceed `max_shard_bytes` (a tensor larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(specs):
        n = specs[key].nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, keys in progress_bar(list(zip(names, shards)), desc=desc, unit="shard"):
        _write_safetensors(dst / name, specs, keys)
    if len(shards) > 1:
        weight_map = {key: name for name, keys in zip(names, shards) for key in keys}
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs.values())}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _check_specs(specs: dict[str, TensorSpec], model_cls, config, src: Path, tied: str | None) -> None:
    """Raise `CheckpointError` unless `specs` has exactly the keys and shapes of `model_cls(config)` (the tied head
    `tied`, when given, excepted)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_cls(config).state_dict().items()}
    if tied is not None:
        expected.pop(tied, None)
    missing = sorted(set(expected) - set(specs))
    unexpected = sorted(set(specs) - set(expected))
    wrong = sorted(f"{k} {specs[k].shape} != {expected[k]}" for k in set(expected) & set(specs)
                   if specs[k].shape != expected[k])
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{src}: the tensors do not match the model its config.json describes: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}. Is the checkpoint complete (all shards present)?"
        )


def _check_not_quantized(source: _Source, src: Path) -> None:
    """Refuse a quantized checkpoint: scale or packed tensors (FP8 block scales, compressed-tensors INT4) or weights
    stored in a dtype that is not a float one (FP8 weights, the packed integer `qweight` of GPTQ / AWQ, bitsandbytes'
    uint8 weights). Integer buffers of other names (position ids) are not weights."""
    stored = [f"{k} stored as {code}" for k in source.keys()
              if k.endswith("weight") and (code := source.dtype_code(k)) not in FLOAT_CODES]
    scales = [k for k in source.keys() if k.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES]
    if scales or stored:
        example = f"{scales[0]}: FP8 block scales or compressed-tensors INT4" if scales else stored[0]
        raise CheckpointError(
            f"{src} holds quantized tensors (e.g. {example}); kimi-vl imports bf16/fp16/fp32 weights only. "
            "Dequantize the checkpoint to bf16 first."
        )


# --------------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 / Kimi K2 text models.

DEEPSEEK_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
TEXT_LAYER_KEY = re.compile(r"^(?:layers|blocks)\.(\d+)\.(.+)$")
EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
ROPE_ROW_TENSORS = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                    "self_attn.kv_a_proj_with_mqa.bias")


def deepseek_v3_config_to_text_config(src: dict, **overrides) -> KimiTextConfig:
    """Map a `deepseek_v3` (or Kimi K2's `kimi_k2`) config.json dict to a `KimiTextConfig`: every layer RoPE-MLA
    (`"mla_rope"`), MoE after `first_k_dense_replace` dense layers, `residual="standard"` unless overridden."""
    from transformers import DeepseekV3Config

    model_type = src.get("model_type")
    if model_type not in DEEPSEEK_MODEL_TYPES:
        raise CheckpointError(f"the text config has model_type={model_type!r}; expected one of {DEEPSEEK_MODEL_TYPES}.")
    if src.get("scoring_func", "sigmoid") != "sigmoid" or src.get("topk_method", "noaux_tc") != "noaux_tc":
        raise CheckpointError(
            f"router scoring_func={src.get('scoring_func')!r} / topk_method={src.get('topk_method')!r}: kimi-vl's "
            "MoE is DeepSeek-V3's sigmoid router with a score-correction bias (noaux_tc) only."
        )
    if src.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"moe_layer_freq={src['moe_layer_freq']}: every layer after the dense ones must be MoE.")
    fields = {k: v for k, v in src.items()
              if k not in ("architectures", "auto_map", "transformers_version", "quantization_config", "model_type")}
    ref = DeepseekV3Config(**fields)
    # MLA expands keys and values for every query head from the latent, whatever num_key_value_heads says (its
    # default, 128, stays in configs with fewer heads; transformers runs those as num_key_value_heads=num_heads).
    if ref.num_key_value_heads is not None and ref.num_key_value_heads < ref.num_attention_heads:
        raise CheckpointError(f"num_key_value_heads={ref.num_key_value_heads} < num_attention_heads="
                              f"{ref.num_attention_heads}: not an MLA layout.")
    if ref.hidden_act != "silu":
        raise CheckpointError(f"hidden_act={ref.hidden_act!r}: kimi-vl's feed-forward is SwiGLU (silu) only.")
    experts = ref.n_routed_experts or 0
    cfg = dict(
        shared_text_fields(ref),
        layer_types=["mla_rope"] * ref.num_hidden_layers,
        mla_kv_norm_eps=1e-6,  # DeepSeek-V3's q_a_layernorm / kv_a_layernorm keep the RMSNorm default
        rope_parameters=dict(ref.rope_parameters),
        max_position_embeddings=ref.max_position_embeddings,
        num_experts=experts,
        num_experts_per_tok=ref.num_experts_per_tok or 1,
        num_shared_experts=ref.n_shared_experts or 0,
        norm_topk_prob=bool(ref.norm_topk_prob),
        n_group=ref.n_group or 1,
        topk_group=ref.topk_group or 1,
        first_k_dense=min(ref.first_k_dense_replace or 0, ref.num_hidden_layers) if experts else ref.num_hidden_layers,
    )
    cfg.update(overrides)
    try:
        return KimiTextConfig(**cfg)
    except ConfigError as e:
        raise CheckpointError(f"the text config cannot be expressed by kimi-vl's backbone: {e}") from e


def _rope_rows(key: str, spec: TensorSpec, cfg: KimiTextConfig) -> TensorSpec:
    """Permute the rope rows of a query / `kv_a_proj_with_mqa` tensor from DeepSeek's interleaved pairs to the
    half-split layout (`rope_interleave=True` checkpoints); identical logits with `kimi_vl.text.rope`."""
    (part,) = spec.parts
    h, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if key.endswith(("q_proj.weight", "q_b_proj.weight")):
        def permute() -> torch.Tensor:
            w = part().reshape(h, nope + rope, -1).clone()
            w[:, nope:] = rope_deinterleave(w[:, nope:].reshape(h * rope, -1), h).reshape(h, rope, -1)
            return w.reshape(spec.shape)
    else:  # kv_a_proj_with_mqa weight [rank + rope, hidden] or bias [rank + rope]
        def permute() -> torch.Tensor:
            w = part().clone()
            w[cfg.kv_lora_rank:] = rope_deinterleave(w[cfg.kv_lora_rank:], 1)
            return w
    return TensorSpec(spec.shape, spec.dtype, [permute])


def deepseek_text_specs(source: _Source, keys: dict[str, str], head_key: str | None, cfg: KimiTextConfig, *,
                        rope_interleave: bool, mtp_layers: int, src: Path) -> dict[str, TensorSpec]:
    """Our `KimiTextForCausalLM` tensors from a DeepSeek-V3 text model's. `keys` maps the source keys with the model
    prefix removed (`embed_tokens.weight`, `layers.3.self_attn.q_b_proj.weight`; `blocks.N` is read as `layers.N`)
    to the full source keys; `head_key` is the LM head's source key (None: tied to the embedding). Per-expert
    `mlp.experts.{e}.gate_proj/up_proj/down_proj` and transformers' packed `mlp.experts.gate_up_proj/down_proj` are
    both read. Layers past `num_hidden_layers` (up to `mtp_layers` multi-token-prediction layers) are skipped."""

    def one(key: str) -> TensorSpec:
        return TensorSpec(source.shape(key), source.dtype(key), [lambda: source.get(key)])

    specs: dict[str, TensorSpec] = {}
    experts: dict[tuple[int, str], dict[int, str]] = {}
    unknown: list[str] = []
    for short, key in keys.items():
        if short in ("embed_tokens.weight", "norm.weight"):
            specs[f"model.{short}"] = one(key)
            continue
        if short.endswith("rotary_emb.inv_freq"):
            continue
        m = TEXT_LAYER_KEY.match(short)
        if m is None:
            unknown.append(key)
            continue
        layer, inner = int(m.group(1)), m.group(2)
        if layer >= cfg.num_hidden_layers:
            if layer >= cfg.num_hidden_layers + mtp_layers:
                unknown.append(key)
            continue
        prefix = f"model.layers.{layer}."
        if (e := EXPERT_KEY.match(inner)) is not None:
            experts.setdefault((layer, EXPERT_NAMES[e.group(2)]), {})[int(e.group(1))] = key
        elif inner == "mlp.experts.gate_up_proj":
            E, two_i, _ = source.shape(key)
            half = two_i // 2
            for name, (lo, hi) in (("w1", (0, half)), ("w3", (half, two_i))):
                shape = (E, hi - lo, source.shape(key)[2])
                parts = [lambda k=key, e=e, lo=lo, hi=hi: source.get_rows(k, e, lo, hi) for e in range(E)]
                specs[f"{prefix}mlp.experts.{name}"] = TensorSpec(shape, source.dtype(key), parts)
        elif inner == "mlp.experts.down_proj":
            specs[f"{prefix}mlp.experts.w2"] = one(key)
        elif inner.startswith("mlp.shared_experts.") and not math.prod(source.shape(key)):
            continue  # transformers' zero-width shared experts (n_shared_experts=0) add nothing; ours has none
        else:
            spec = one(key)
            if rope_interleave and inner in ROPE_ROW_TENSORS:
                spec = _rope_rows(inner, spec, cfg)
            specs[prefix + inner] = spec
    if unknown:
        raise CheckpointError(f"{src}: unrecognised text-model tensors {sorted(unknown)[:5]}.")
    for (layer, name), members in sorted(experts.items()):
        missing = [e for e in range(cfg.num_experts) if e not in members]
        if missing:
            source_name = next(k for k, v in EXPERT_NAMES.items() if v == name)
            raise CheckpointError(f"{src}: layer {layer} lacks expert {missing[0]}'s {source_name} weight "
                                  f"({len(missing)} of {cfg.num_experts} experts missing); is a shard missing?")
        ordered = [members[e] for e in range(cfg.num_experts)]
        shape = (len(ordered), *source.shape(ordered[0]))
        specs[f"model.layers.{layer}.mlp.experts.{name}"] = TensorSpec(
            shape, source.dtype(ordered[0]), [lambda k=k: source.get(k) for k in ordered])
    if head_key is not None:
        specs["lm_head.weight"] = one(head_key)
    if cfg.residual != "standard":  # AttnRes from zero pseudo-queries: the converted model equals the released one
        from .text.modeling import build_residual

        dtype = specs["model.embed_tokens.weight"].dtype if "model.embed_tokens.weight" in specs else torch.float32
        for name, t in build_residual(cfg).state_dict().items():
            specs[f"model.residual.{name}"] = TensorSpec(tuple(t.shape), dtype, [lambda t=t: t.to(dtype)])
    return specs


def _text_keys(keys: list[str], prefixes: tuple[str, ...], head_keys: tuple[str, ...]) -> tuple[dict[str, str],
                                                                                                 str | None]:
    text = {}
    for key in keys:
        for p in prefixes:
            if key.startswith(p):
                text[key[len(p):]] = key
                break
    head = next((k for k in head_keys if k in keys), None)
    return text, head


def _tie(head_key: str | None, configured: bool, src: Path, has_embedding: bool) -> bool:
    """Whether the converted model ties its head: when the source has no head tensor and its config ties it."""
    if head_key is not None:
        return False
    if configured and has_embedding:
        return True
    raise CheckpointError(f"{src} has no LM head tensor (lm_head.weight) and its config does not tie it to the "
                          "embedding; is a shard missing?")


def _dtype_of(specs: dict[str, TensorSpec]) -> torch.dtype:
    spec = specs.get("model.embed_tokens.weight") or specs.get("language_model.model.embed_tokens.weight")
    return spec.dtype if spec is not None else torch.float32


CONVERTERS = {"kimi_linear": "kimi-vl convert kimi-linear", "kimi_k25": "kimi-vl convert kimi-k25",
              "deepseek_v3": "kimi-vl convert deepseek-v3", "kimi_k2": "kimi-vl convert deepseek-v3"}
"""model_type -> the command that imports it (named in the error for a checkpoint of another type)."""


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer, chat template and generation files of `src` into `dst`, with the remote-code modules that
    `tokenizer_config.json`'s `auto_map` names (the released Kimi repos' `tokenization_kimi.py`), so the tokenizer
    loads from `dst` as it does from `src`."""
    for name in TOKENIZER_FILES + _tokenizer_modules(src):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _tokenizer_modules(src: Path) -> tuple[str, ...]:
    """The `module.py` files holding the tokenizer classes that `src/tokenizer_config.json`'s `auto_map` names
    (`"AutoTokenizer": ["module.Class", fast or null]`, or the older bare pair; a `repo--module.Class` reference
    lives in another repository), with the modules they import relatively (the released K2 / K2.5
    `tokenization_kimi.py` imports `.tool_declaration_ts`), as transformers loads them."""
    from transformers.dynamic_module_utils import get_relative_import_files

    try:
        auto_map = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8")).get("auto_map")
    except (OSError, ValueError, AttributeError):  # none, unreadable or not an object: it names no module
        return ()
    refs = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    refs = refs if isinstance(refs, list) else [refs]
    modules = {f"{ref.rsplit('.', 1)[0]}.py" for ref in refs if isinstance(ref, str) and "." in ref and "--" not in ref}
    for module in sorted(modules):
        try:
            modules.update(Path(f).name for f in get_relative_import_files(src / module))
        except OSError:  # the module, or one it imports, is not in `src`: it does not load there either
            continue
    return tuple(sorted(modules))


def convert_deepseek_v3(src_dir: str | Path, dst_dir: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                        overwrite: bool = False, **config_overrides) -> Path:
    """Convert a transformers `deepseek_v3` (or Kimi K2 `kimi_k2`) text checkpoint into a `kimi_vl_text` one that
    `KimiTextForCausalLM.from_pretrained` loads (every layer `"mla_rope"`). `config_overrides` set fields of the
    new `KimiTextConfig` (e.g. `residual="block_attnres"`: zero pseudo-queries, logits unchanged). Streams (see
    the module docstring); tokenizer files are copied. Returns the destination directory."""
    from .text import KimiTextForCausalLM

    src, dst = Path(src_dir), Path(dst_dir)
    raw = load_config_json(src, DEEPSEEK_MODEL_TYPES, "convert_deepseek_v3", CONVERTERS)
    cfg = deepseek_v3_config_to_text_config(raw, **config_overrides)
    source = _Source(src)
    keys = source.keys()
    _check_not_quantized(source, src)
    text, head = _text_keys(keys, ("model.",), ("lm_head.weight",))
    unknown = sorted(set(keys) - set(text.values()) - {head})
    if unknown:
        raise CheckpointError(f"{src}: unrecognised tensors {unknown[:5]}.")
    tied = _tie(head, bool(raw.get("tie_word_embeddings", False)), src, "embed_tokens.weight" in text)
    cfg.tie_word_embeddings = tied
    specs = deepseek_text_specs(source, text, head, cfg, rope_interleave=raw.get("rope_interleave", True),
                                mtp_layers=raw.get("num_nextn_predict_layers", 0) or 0, src=src)
    _check_specs(specs, KimiTextForCausalLM, cfg, src, "lm_head.weight" if tied else None)
    cfg.architectures = ["KimiTextForCausalLM"]
    cfg.dtype = _dtype_of(specs)
    with staged_directory(dst, overwrite, src) as tmp:
        write_streamed_shards(specs, tmp, max_shard_bytes)
        cfg.save_pretrained(tmp)
        _copy_tokenizer_files(src, tmp)
    return dst


# --------------------------------------------------------------------------------------------------------------------
# Whole Kimi K2.5 / K2.6 vision-language models.

K25_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
K25_HEAD_KEYS = ("language_model.lm_head.weight", "lm_head.weight")


def kimi_k25_config(raw: dict, vision_config: MoonViTConfig, **text_overrides: Any) -> KimiVLConfig:
    """The `KimiVLConfig` of a `kimi_k25` config.json dict (its `text_config` through
    `deepseek_v3_config_to_text_config`; placeholder, vision start/end ids and projector eps carried over)."""
    from transformers import Kimi_K25Config

    from .configuration import KimiVLConfig

    text_raw = dict(raw.get("text_config") or {})
    text_raw.setdefault("model_type", "deepseek_v3")
    text_config = deepseek_v3_config_to_text_config(text_raw, **text_overrides)
    fields = {k: v for k, v in raw.items()
              if k not in ("architectures", "auto_map", "transformers_version", "quantization_config", "model_type",
                           "text_config", "vision_config")}
    ref = Kimi_K25Config(**fields)
    image_token_id = raw.get("image_token_id", raw.get("media_placeholder_token_id", ref.image_token_id))
    try:
        return KimiVLConfig(
            vision_config=vision_config, text_config=text_config, image_token_id=image_token_id,
            video_token_id=ref.video_token_id, vision_start_token_id=ref.vision_start_token_id,
            vision_end_token_id=ref.vision_end_token_id,
            projector_layer_norm_eps=vision_config.projector_layer_norm_eps,
        )
    except ConfigError as e:
        raise CheckpointError(f"the kimi_k25 config cannot be carried over: {e}") from e


def convert_kimi_k25(src_dir: str | Path, dst_dir: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     overwrite: bool = False, **overrides) -> Path:
    """Convert a transformers `kimi_k25` checkpoint (Kimi K2.5 / K2.6 layout: MoonViT-3D + projector + DeepSeek-V3
    text model) into a `KimiVLForConditionalGeneration` checkpoint.

    Imported: the vision tower and projector (`convert_kimi_k25_vision`'s mapping), the text model (every layer
    RoPE-MLA with the source's `rope_parameters` and YaRN scaling, `q_lora_rank`, grouped sigmoid routing with the
    correction bias, shared experts, dense first layers, `attention_bias`; `rope_interleave` rows permuted to the
    half-split layout), the LM head (or its tie to the embedding), the placeholder ids (`image_token_id`, or the
    released `media_placeholder_token_id`; `video_token_id`), `vision_start_token_id` / `vision_end_token_id`, the
    projector eps, the tokenizer and generation files, and the processor settings: when the source's tokenizer
    loads (`AutoTokenizer`, no remote code) and holds Kimi's media tokens, a `KimiVLProcessor` with MoonViT image
    and video processors of the source's settings is saved. Not imported: multi-token-prediction layers (skipped),
    quantized tensors (FP8 / INT4: refused; dequantize to bf16 first), remote-code tokenizers (their files are
    copied, but no processor is written; `KimiVLProcessor.from_pretrained` needs a fast tokenizer).

    Args:
        src_dir: directory with `config.json` (`model_type: kimi_k25`) and `*.safetensors` (sharded or not;
            transformers' key names or the released ones).
        dst_dir: destination (must not exist or be empty unless `overwrite`); written atomically.
        max_shard_bytes: output shard size.
        overrides: fields of the new text config, e.g. `residual="block_attnres"` (zero pseudo-queries: logits
            equal to the standard-residual conversion's; depth-wise mixing is learned in fine-tuning).

    Raises:
        CheckpointError: no or another model type, quantized or missing or unrecognised tensors, a config kimi-vl
            cannot express. Nothing is written to `dst_dir` then.
    """
    from .modeling import KimiVLForConditionalGeneration

    src, dst = Path(src_dir), Path(dst_dir)
    raw = load_config_json(src, ("kimi_k25",), "convert_kimi_k25", CONVERTERS)
    vision_config, _ = read_source_config(src)
    config = kimi_k25_config(raw, vision_config, **overrides)
    text_cfg = config.text_config
    source = _Source(src)
    keys = source.keys()
    _check_not_quantized(source, src)
    text, head = _text_keys(keys, K25_TEXT_PREFIXES, K25_HEAD_KEYS)
    vision, projector, unknown = collect_vision_weights(
        [k for k in keys if k.startswith(VISION_PREFIXES + PROJECTOR_PREFIXES)], source.get, "kimi_k25",
        vision_config.num_attention_heads, src)
    unknown += sorted(set(keys) - set(text.values()) - {head}
                      - {k for k in keys if k.startswith(VISION_PREFIXES + PROJECTOR_PREFIXES)})
    if unknown:
        raise CheckpointError(f"{src}: unrecognised tensors {sorted(unknown)[:5]}.")
    text_raw = raw.get("text_config") or {}
    configured_tie = bool(raw.get("tie_word_embeddings", True) or text_raw.get("tie_word_embeddings", False))
    tied = _tie(head, configured_tie, src, "embed_tokens.weight" in text)
    text_cfg.tie_word_embeddings = config.tie_word_embeddings = tied
    text_specs = deepseek_text_specs(source, text, head, text_cfg,
                                     rope_interleave=text_raw.get("rope_interleave", True),
                                     mtp_layers=text_raw.get("num_nextn_predict_layers", 0) or 0, src=src)
    specs = {f"language_model.{k}": v for k, v in text_specs.items()}
    for prefix, state in (("vision_tower.", vision), ("multi_modal_projector.", projector)):
        for k, t in state.items():
            specs[prefix + k] = TensorSpec(tuple(t.shape), t.dtype, [lambda t=t: t])
    _check_specs(specs, KimiVLForConditionalGeneration, config, src, "language_model.lm_head.weight" if tied else None)
    config.architectures = ["KimiVLForConditionalGeneration"]
    config.dtype = text_cfg.dtype = _dtype_of(specs)
    with staged_directory(dst, overwrite, src) as tmp:
        write_streamed_shards(specs, tmp, max_shard_bytes)
        config.save_pretrained(tmp)
        _copy_tokenizer_files(src, tmp)
        _save_processor(src, tmp, config)
    return dst


def _processor_settings(src: Path) -> tuple[dict, dict]:
    """The image and video processor settings saved in the source (`processor_config.json`'s nested dicts, or the
    older separate files), without their class names."""
    image, video = {}, {}
    if (src / "processor_config.json").is_file():
        saved = json.loads((src / "processor_config.json").read_text())
        image, video = saved.get("image_processor") or {}, saved.get("video_processor") or {}
    if not image and (src / "preprocessor_config.json").is_file():
        image = json.loads((src / "preprocessor_config.json").read_text())
    if not video and (src / "video_preprocessor_config.json").is_file():
        video = json.loads((src / "video_preprocessor_config.json").read_text())
    return image, video


def _save_processor(src: Path, dst: Path, config) -> None:
    """Save a `KimiVLProcessor` into `dst` (tokenizer from `src`, MoonViT processors with the source's settings) when
    the source's tokenizer loads without remote code and holds Kimi's media tokens; otherwise warn and write none."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from .processing import KimiVLProcessor
    from .vision import MoonViTImageProcessor, MoonViTVideoProcessor

    log = logging.get_logger(__name__)
    if not any((src / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tiktoken.model")):
        log.warning(f"{src} has no tokenizer files: the converted model has no processor; save a KimiVLProcessor "
                    "into it before `kimi-vl train` or the demos.")
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any loading failure means: no processor, say why
        log.warning(f"the tokenizer of {src} does not load without remote code ({type(e).__name__}: {e}); its files "
                    "are copied but no KimiVLProcessor is written.")
        return
    image, video = _processor_settings(src)
    image = {k: v for k, v in image.items() if hasattr(MoonViTImageProcessor, k) and not k.endswith("_type")}
    video = {k: v for k, v in video.items() if hasattr(MoonViTVideoProcessor, k) and not k.endswith("_type")}
    try:
        processor = KimiVLProcessor(MoonViTImageProcessor(**image), tokenizer, MoonViTVideoProcessor(**video))
    except ConfigError as e:
        log.warning(f"no KimiVLProcessor written: {e}")
        return
    ids = {"image": (processor.image_token_id, config.image_token_id),
           "video": (processor.video_token_id, config.video_token_id)}
    wrong = {k: v for k, v in ids.items() if v[0] != v[1]}
    if wrong:
        raise CheckpointError(f"{src}: the tokenizer's placeholder ids {({k: v[0] for k, v in wrong.items()})} differ "
                              f"from config.json's {({k: v[1] for k, v in wrong.items()})}.")
    processor.save_pretrained(dst)
