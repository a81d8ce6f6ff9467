"""Import released Hugging Face checkpoints into kimi-vl's own formats.

`convert_kimi_k25_vision` (MoonViT-3D + projector from a `kimi_k25` checkpoint) lives in
`kimi_vl.vision.convert` and is re-exported here.

`convert_kimi_linear` reads a `kimi_linear` checkpoint directory (the released Kimi-Linear format with
`block_sparse_moe.experts.{e}.w1/w2/w3` and per-projection convs, or transformers' native layout with packed
`conv1d`, `forget_gate.*` and `experts.gate_up_proj`; sharded or not) and writes a `kimi_vl_text` checkpoint
that `KimiTextForCausalLM.from_pretrained` loads. Tensors are streamed shard by shard, so converting needs
about one output shard of memory, not the whole model.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .errors import CheckpointError
from .text.configuration import KimiTextConfig
from .vision.convert import convert_kimi_k25_vision

__all__ = ["assemble_kimi_vl", "convert_kimi_k25_vision", "convert_kimi_linear", "kimi_linear_config_to_text_config"]

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
    if ref.num_key_value_heads not in (None, ref.num_attention_heads):
        raise CheckpointError("MLA with num_key_value_heads != num_attention_heads is not a Kimi-Linear layout.")
    dense = [t == "dense" for t in ref.mlp_layer_types]
    first_k_dense = dense.index(False) if False in dense else len(dense)
    if any(dense[first_k_dense:]):
        raise CheckpointError(f"Dense FFN layers must come first; got mlp_layer_types={ref.mlp_layer_types}.")
    kinds = {"linear_attention": "kda", "full_attention": "mla"}
    if any(t not in kinds for t in ref.layer_types):
        raise CheckpointError(f"Unknown layer types in {ref.layer_types}.")
    cfg = dict(
        vocab_size=ref.vocab_size,
        hidden_size=ref.hidden_size,
        intermediate_size=ref.intermediate_size,
        num_hidden_layers=ref.num_hidden_layers,
        layer_types=[kinds[t] for t in ref.layer_types],
        num_attention_heads=ref.num_attention_heads,
        q_lora_rank=ref.q_lora_rank,
        kv_lora_rank=ref.kv_lora_rank,
        qk_nope_head_dim=ref.qk_nope_head_dim,
        qk_rope_head_dim=ref.qk_rope_head_dim,
        v_head_dim=ref.v_head_dim,
        kda_num_heads=ref.linear_num_heads,
        kda_head_dim=ref.linear_head_dim,
        short_conv_kernel_size=ref.linear_conv_kernel_dim,
        num_experts=ref.num_local_experts,
        num_experts_per_tok=ref.num_experts_per_tok,
        num_shared_experts=ref.n_shared_experts,
        moe_intermediate_size=ref.moe_intermediate_size,
        routed_scaling_factor=ref.routed_scaling_factor,
        norm_topk_prob=ref.norm_topk_prob,
        n_group=ref.n_group,
        topk_group=ref.topk_group,
        first_k_dense=first_k_dense,
        rms_norm_eps=ref.rms_norm_eps,
        initializer_range=ref.initializer_range,
        tie_word_embeddings=ref.tie_word_embeddings,
        pad_token_id=ref.pad_token_id,
        bos_token_id=ref.bos_token_id,
        eos_token_id=ref.eos_token_id,
        residual="standard",
    )
    cfg.update(overrides)
    return KimiTextConfig(**cfg)


class _Source:
    """Lazy access to every tensor of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, src_dir: Path) -> None:
        files = sorted(src_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"No *.safetensors files in {src_dir}; kimi-vl reads safetensors checkpoints only.")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {key: h for h in self.handles for key in h.keys()}

    def keys(self) -> list[str]:
        return list(self.where)

    def get(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)


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


def _check_against_model(plan: dict, cfg: KimiTextConfig) -> None:
    from .text import KimiTextForCausalLM

    with torch.device("meta"):
        model = KimiTextForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        plan.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(plan))
    extra = sorted(set(plan) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"The checkpoint does not match its config: missing {missing[:5]}, unexpected {extra[:5]}."
        )


def convert_kimi_linear(
    src_dir: str | Path, dst_dir: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, **config_overrides
) -> Path:
    """Convert a transformers `kimi_linear` checkpoint directory into a `kimi_vl_text` one.

    `config_overrides` set fields of the new `KimiTextConfig` (e.g. `residual="block_attnres"`,
    `router_biased_weights=True` to reproduce the released remote code's router exactly).
    Returns the destination directory.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} has no config.json: pass a Hugging Face checkpoint directory.")
    cfg = kimi_linear_config_to_text_config(json.loads((src / "config.json").read_text()), **config_overrides)
    source = _Source(src)
    plan = _plan(source.keys(), cfg)
    _check_against_model(plan, cfg)

    dst.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in tqdm(sorted(plan), desc="converting", unit="tensor"):
        t = plan[key](source)
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.numel() * t.element_size()
    _write_shards(shards, dst)
    cfg.architectures = ["KimiTextForCausalLM"]
    cfg.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def _write_shards(shards: list[dict[str, torch.Tensor]], dst: Path) -> None:
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / name), metadata=meta)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def assemble_kimi_vl(
    vision_dir: str | Path,
    text: str | Path | KimiTextConfig,
    *,
    image_token_id: int,
    video_token_id: int,
):
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
