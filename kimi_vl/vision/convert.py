"""Import the vision tower (and multimodal projector) of a transformers `kimi_k25` checkpoint.

Accepted sources (a directory with `config.json` + one or more `*.safetensors` shards):

* `model_type == "kimi_k25"` (the full Kimi K2.5 / K2.6 model): only the vision tower and the projector are read;
  the language model's tensors are never loaded.
* `model_type == "kimi_k25_vision"` (a bare `Kimi_K25VisionModel`): vision tower only, no projector.

Both key layouts are understood: transformers' own (`layers.N.attn.q_proj`, ...) and the released one that
`Kimi_K25ForConditionalGeneration.save_pretrained` writes back (`vision_tower.encoder.blocks.N.wqkv` with the
rotary q/k rows interleaved per head, `norm0/norm1`, `mlp.fc0/fc1`, `wo`, `mm_projector.proj.0/2`).
The destination holds `config.json` (a `MoonViTConfig`), `model.safetensors` (the MoonViT weights) and, when the
source has a projector, `projector.safetensors` (load it with `MoonViTProjector.from_pretrained`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, hub_id_hint, read_config_file
from .configuration import MoonViTConfig
from .moonvit import MoonViTModel
from .projector import PROJECTOR_WEIGHTS, MoonViTProjector

MODEL_TYPES = ("kimi_k25", "kimi_k25_vision")
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.encoder.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.mm_projector.", "mm_projector.")

# Per-block renames (the part after `layers.N.` / `blocks.N.`), transformers layout and released layout.
BLOCK_RENAMES = {
    "norm1": "norm1", "norm2": "norm2", "attn.proj": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
RELEASED_BLOCK_RENAMES = {
    "norm0": "norm1", "norm1": "norm2", "wo": "attn.proj", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2",
}
TOP_RENAMES = {
    "patch_embed.proj": "patch_embed.proj",
    "final_layernorm": "final_layernorm",
}
POS_EMB_KEYS = ("patch_embed.pos_emb.position_embeddings", "patch_embed.pos_emb.weight")
PROJECTOR_RENAMES = {"pre_norm": "pre_norm", "in_proj": "mlp.fc1", "proj.0": "mlp.fc1",
                     "out_proj": "mlp.fc2", "proj.2": "mlp.fc2"}
QKV_PARTS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "wqkv")
BLOCK_KEY = re.compile(r"^(layers|blocks)\.(\d+)\.(.+)\.(weight|bias)$")
RELEASED_VISION_FIELDS = {
    "hidden_size": "vt_hidden_size", "num_attention_heads": "vt_num_attention_heads",
    "num_hidden_layers": "vt_num_hidden_layers", "intermediate_size": "vt_intermediate_size",
    "pos_emb_height": "init_pos_emb_height", "pos_emb_width": "init_pos_emb_width", "pos_emb_time": "init_pos_emb_time",
}
"""transformers' `Kimi_K25VisionConfig` field -> its name in the released remote-code `vision_config` (which also
holds the projector's `projector_ln_eps` and input width `mm_hidden_size`)."""


def load_config_json(src: Path, expected: tuple[str, ...], converter: str,
                     tips: dict[str, str] | None = None) -> dict:
    """`src/config.json` as a dict; `CheckpointError` when it is missing or its `model_type` is not in `expected`
    (naming, from `tips` (model_type -> command), the command that imports that type instead)."""
    config_file = src / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} not found: point {converter} at a transformers checkpoint directory "
                              "(config.json + *.safetensors)." + hub_id_hint(src))
    raw = read_config_file(config_file)
    model_type = raw.get("model_type")
    if model_type not in expected:
        tip = f" Use `{tips[model_type]}` for that model type." if model_type in (tips or {}) else ""
        raise CheckpointError(f"{config_file} has model_type={model_type!r}; {converter} expects one of {expected}."
                              + tip)
    return raw


def safetensors_files(src: Path, *, complete: bool = True) -> list[Path]:
    """The weight files of the checkpoint directory `src`, sorted, chosen as transformers' `from_pretrained` chooses
    them: `model.safetensors`, else the shards that `model.safetensors.index.json` names (a stale shard of an
    earlier download beside them is not read), else every `*.safetensors`. `CheckpointError` when a shard the index
    names is absent (unless not `complete`: then the present ones) or when there are none (saying how to re-save
    PyTorch pickle weights, `pytorch_model*.bin`, which kimi-vl never unpickles)."""
    index = src / "model.safetensors.index.json"
    if (src / "model.safetensors").is_file():
        files = [src / "model.safetensors"]
    elif index.is_file():
        names = set(read_config_file(index).get("weight_map", {}).values())
        absent = sorted(name for name in names if not (src / name).is_file())
        if absent and complete:
            raise CheckpointError(f"{src}: shards listed in model.safetensors.index.json are missing: {absent[:3]}; "
                                  "download the complete checkpoint.")
        files = sorted(src / name for name in names if (src / name).is_file())
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in src.glob("*.bin"))
        found = (f" It holds PyTorch pickle weights ({pickles[0]}), which kimi-vl does not unpickle: re-save them as "
                 "safetensors (transformers' `from_pretrained(src)` then `save_pretrained(new_dir)` writes them) and "
                 "convert that directory.") if pickles else ""
        raise CheckpointError(f"No *.safetensors files in {src}; kimi-vl reads safetensors checkpoints only." + found)
    return files


def read_source_config(src: Path) -> tuple[MoonViTConfig, str]:
    """The `MoonViTConfig` equivalent to the source's vision (and projector) config, and the source model_type."""
    raw = load_config_json(src, MODEL_TYPES, "convert_kimi_k25_vision")
    model_type, config_file = raw["model_type"], src / "config.json"
    vision = raw if model_type == "kimi_k25_vision" else raw.get("vision_config") or {}

    def field(name: str, default):
        return vision.get(name, vision.get(RELEASED_VISION_FIELDS.get(name, name), default))

    fields = {
        "patch_size": vision.get("patch_size", 14),
        "hidden_size": field("hidden_size", 1152),
        "num_attention_heads": field("num_attention_heads", 16),
        "num_hidden_layers": field("num_hidden_layers", 27),
        "intermediate_size": field("intermediate_size", 4304),
        "hidden_act": vision.get("hidden_act", "gelu_pytorch_tanh"),
        "pos_emb_height": field("pos_emb_height", 64),
        "pos_emb_width": field("pos_emb_width", 64),
        "temporal_chunk_size": field("pos_emb_time", 4),
        "merge_kernel_size": vision.get("merge_kernel_size", [2, 2]),
        "rope_theta": (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0),
    }
    if model_type == "kimi_k25":
        text = raw.get("text_config") or {}
        if "hidden_size" not in text:
            raise CheckpointError(f"{config_file}: text_config.hidden_size is missing (the projector's output width).")
        fields["projector_out_size"] = text["hidden_size"]
        fields["projector_layer_norm_eps"] = raw.get("projection_layer_norm_eps", field("projector_ln_eps", 1e-5))
        norm_size = raw.get("projection_hidden_size", field("mm_hidden_size", fields["hidden_size"]))
        if norm_size != fields["hidden_size"]:
            raise CheckpointError(f"{config_file}: projection_hidden_size={norm_size} differs from the vision "
                                  f"hidden_size={fields['hidden_size']}; the projector norms each vision patch.")
    if "dtype" in vision or "dtype" in raw:
        fields["dtype"] = vision.get("dtype", raw.get("dtype"))
    return MoonViTConfig(**fields), model_type


def rope_deinterleave(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Released q/k rows are interleaved per head (`(pair, re/im)`); transformers uses rotate-half (`(re/im, pair)`)."""
    head_dim = tensor.shape[0] // num_heads
    return tensor.reshape(num_heads, head_dim // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def map_vision_key(key: str) -> tuple[str, str | None] | None:
    """Our name for a vision key (prefix already stripped), or `None` for an unknown key (the caller checks
    completeness against the model). The second item names the part of the fused `qkv` that the key holds
    (`"attn.q_proj"`, `"attn.k_proj"`, `"attn.v_proj"` or the released fused `"wqkv"`), else `None`."""
    if key in POS_EMB_KEYS:
        return "patch_embed.pos_emb", None
    for name in ("weight", "bias"):
        for src, dst in TOP_RENAMES.items():
            if key == f"{src}.{name}":
                return f"{dst}.{name}", None
    match = BLOCK_KEY.match(key)
    if match is None:
        return None
    kind, index, inner, name = match.groups()
    renames = BLOCK_RENAMES if kind == "layers" else RELEASED_BLOCK_RENAMES
    if inner in renames:
        return f"layers.{index}.{renames[inner]}.{name}", None
    if inner in QKV_PARTS:
        return f"layers.{index}.attn.qkv.{name}", inner
    return None


@contextmanager
def staged_directory(dst: Path, overwrite: bool = False, source: Path | None = None) -> Iterator[Path]:
    """Yield a fresh temporary sibling of `dst`; on success it replaces `dst` (rename), on failure it is removed, so
    `dst` never holds a partial result. An existing non-empty `dst` is refused unless `overwrite`, and a `dst` that is
    or holds the `source` folder is refused always (replacing it would delete the source)."""
    if source is not None and source.resolve().is_relative_to(dst.resolve()):
        raise CheckpointError(f"{dst} is or holds the source {source}: replacing it would delete the source; write to "
                              "a folder outside it.")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise CheckpointError(f"{dst} already exists and is not empty; remove it, choose another destination, or pass "
                              "overwrite=True (--overwrite).")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            old.rmdir()
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_kimi_k25_vision(src_dir: str | Path, dst_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Convert a transformers `kimi_k25` (or `kimi_k25_vision`) checkpoint into a MoonViT directory.

    Args:
        src_dir: directory with `config.json` and `*.safetensors` (sharded or not).
        dst_dir: output directory, written atomically (`staged_directory`): it must not exist or be empty unless
            `overwrite` (then replaced whole: no projector of an earlier conversion stays beside a tower without
            one); `MoonViTModel.from_pretrained(dst_dir)` loads it, and `MoonViTProjector.from_pretrained(dst_dir)`
            loads the projector when the source has one.
        overwrite: replace an existing non-empty `dst_dir`.

    Returns:
        `dst_dir` as a `Path`.

    Raises:
        CheckpointError: missing `config.json` or weights, a wrong `model_type`, no vision weights, vision or
            projector tensors it does not recognise, or vision weights that do not fill the model described by the
            config.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    config, model_type = read_source_config(src)
    handles = [safe_open(str(shard), framework="pt") for shard in safetensors_files(src, complete=False)]
    where = {key: h for h in handles for key in h.keys()}
    vision, projector, unknown = collect_vision_weights(where, lambda key: where[key].get_tensor(key), model_type,
                                                        config.num_attention_heads, src)
    if not vision:
        raise CheckpointError(f"{src} holds no vision-tower weights (expected keys under {VISION_PREFIXES}).")
    if unknown:
        raise CheckpointError(f"{src}: unrecognised vision-tower or projector tensors {sorted(unknown)[:5]}; kimi-vl's "
                              "MoonViT-3D has no place for them (is this a MoonViT of another design?).")

    check_complete(MoonViTModel, config, vision, src, "vision tower")
    if model_type == "kimi_k25":
        if not projector:
            raise CheckpointError(f"{src} holds no multimodal projector weights (expected keys under "
                                  f"{PROJECTOR_PREFIXES}).")
        check_complete(lambda c: MoonViTProjector.from_config(c), config, projector, src, "projector")

    config.architectures = [MoonViTModel.__name__]
    with staged_directory(dst, overwrite, src) as tmp:
        config.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in vision.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        if projector:
            save_file({k: v.contiguous() for k, v in projector.items()}, str(tmp / PROJECTOR_WEIGHTS),
                      metadata={"format": "pt"})
    return dst


def collect_vision_weights(
    keys: Iterable[str], get: Callable[[str], torch.Tensor], model_type: str, num_heads: int, src: Path
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Our MoonViT and projector state dicts from a source's tensors (`keys`, `get(key) -> tensor`), reading only
    the vision and projector tensors; also the keys under the vision / projector prefixes that map to nothing (the
    caller decides whether they matter). The fused `qkv` is assembled (released `wqkv` de-interleaved)."""
    vision: dict[str, torch.Tensor] = {}
    projector: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key in keys:
        if model_type == "kimi_k25_vision":
            vision_key = key
        else:
            vision_key = next((key[len(p):] for p in VISION_PREFIXES if key.startswith(p)), None)
        if vision_key is not None:
            mapped = map_vision_key(vision_key)
            if mapped is not None and mapped[1] is None:
                vision[mapped[0]] = get(key)
            elif mapped is not None:
                qkv.setdefault(mapped[0], {})[mapped[1]] = get(key)
            else:
                unknown.append(key)
            continue
        proj_key = next((key[len(p):] for p in PROJECTOR_PREFIXES if key.startswith(p)), None)
        if proj_key is not None:
            stem, _, name = proj_key.rpartition(".")
            if stem in PROJECTOR_RENAMES:
                projector[f"{PROJECTOR_RENAMES[stem]}.{name}"] = get(key)
            else:
                unknown.append(key)

    for fused, parts in qkv.items():
        if "wqkv" in parts:
            q, k, v = parts["wqkv"].chunk(3, dim=0)
            vision[fused] = torch.cat([rope_deinterleave(q, num_heads), rope_deinterleave(k, num_heads), v])
        elif len(parts) == 3:
            vision[fused] = torch.cat([parts["attn.q_proj"], parts["attn.k_proj"], parts["attn.v_proj"]])
        else:
            raise CheckpointError(f"{src}: {fused} needs q_proj, k_proj and v_proj; found only {sorted(parts)}.")
    return vision, projector, unknown


def check_complete(
    build: Callable[[MoonViTConfig], torch.nn.Module],
    config: MoonViTConfig,
    state: dict[str, torch.Tensor],
    src: Path,
    what: str,
) -> None:
    """Raise `CheckpointError` unless `state` has exactly the keys and shapes of `build(config)`."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in build(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if state[k].shape != expected[k])
    if missing or unexpected or wrong:
        raise CheckpointError(f"{src}: the {what} weights do not match its config: missing {missing[:6]}, "
                              f"unexpected {unexpected[:6]}, wrong shape {wrong[:6]}.")
