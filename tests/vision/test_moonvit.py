"""MoonViT-3D: parity with transformers' `Kimi_K25VisionModel` / `Kimi_K25MultimodalProjection` through the
converter, pack isolation, video chunking, converter and config errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.kimi_k25 import configuration_kimi_k25 as hf_config
from transformers.models.kimi_k25 import modeling_kimi_k25 as hf_model

from kimi_vl.errors import CheckpointError, ConfigError, ShapeError
from kimi_vl.vision import MoonViTConfig, MoonViTModel, MoonViTProjector
from kimi_vl.vision.convert import convert_kimi_k25_vision

VISION = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
              pos_emb_height=8, pos_emb_width=8)
TEXT = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1,
            first_k_dense_replace=1, n_group=1, topk_group=1)
# the table size (identity resampling), non-square both ways, the 2x2 minimum, larger than the 8x8 table
IMAGES = [[1, 8, 8], [1, 4, 6], [1, 6, 4], [1, 2, 2], [1, 10, 12]]
TOL = dict(rtol=0, atol=1e-5)


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, norms included, with scales that keep activations O(1) but far from constant."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.numel():  # e.g. transformers' zero-width shared experts
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            elif "position_embeddings" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p[0].numel() ** -0.5)


def pixels(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def run_theirs(vision_tower, px, calls):
    """transformers' tower over several calls (it cannot mix images and multi-frame chunks in one call)."""
    outs, start = [], 0
    with torch.no_grad():
        for grids in calls:
            n = sum(t * h * w for t, h, w in grids)
            outs.append(vision_tower(px[start:start + n], grid_thw=torch.tensor(grids)))
            start += n
    return BaseModelOutputWithPooling(last_hidden_state=torch.cat([o.last_hidden_state for o in outs]),
                                      pooler_output=torch.cat([o.pooler_output for o in outs]))


def run_ours(model, px, grids):
    with torch.no_grad():
        return model(px, torch.tensor(grids))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A random tiny `Kimi_K25ForConditionalGeneration` saved by transformers (sharded) and converted."""
    torch.manual_seed(0)
    config = hf_config.Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=64)
    config.vision_config._attn_implementation = "sdpa"
    reference = hf_model.Kimi_K25ForConditionalGeneration(config).eval()
    randomise(reference)
    src = tmp_path_factory.mktemp("k25")
    reference.save_pretrained(src, max_shard_size="100KB")
    dst = convert_kimi_k25_vision(src, tmp_path_factory.mktemp("moonvit"))
    return reference, src, dst, MoonViTModel.from_pretrained(dst).eval()


def test_parity_images_and_video_in_one_pack(full):
    reference, _, _, ours = full
    video = [[8, 4, 4], [5, 2, 4]]  # 8 frames = two 4-frame chunks; 5 frames = a 4-frame chunk + a single frame
    px = pixels(IMAGES + video)
    a = run_theirs(reference.model.vision_tower, px, [IMAGES, [[4, 4, 4], [4, 4, 4], [4, 2, 4]], [[1, 2, 4]]])
    b = run_ours(ours, px, IMAGES + video)
    assert b.last_hidden_state.shape == (px.shape[0], 64)
    assert b.pooler_output.shape == a.pooler_output.shape == (16 + 6 + 6 + 1 + 30 + 2 * 4 + 2 * 2, 4, 64)
    assert a.last_hidden_state.std() > 0.5 and a.pooler_output.std() > 0.3  # outputs are far from constant
    torch.testing.assert_close(b.last_hidden_state, a.last_hidden_state, **TOL)
    torch.testing.assert_close(b.pooler_output, a.pooler_output, **TOL)


def test_video_time_embedding_matters_and_chunks_equal_rows(full):
    *_, ours = full
    grids = [[8, 4, 4]]
    px = pixels(grids)
    whole = run_ours(ours, px, grids)
    rows = run_ours(ours, px, [[4, 4, 4], [4, 4, 4]])
    torch.testing.assert_close(whole.pooler_output, rows.pooler_output, rtol=0, atol=0)
    frames = run_ours(ours, px, [[1, 4, 4]] * 8)  # frames as separate images: no time embedding, no joint attention
    assert (frames.last_hidden_state - whole.last_hidden_state).abs().max() > 1e-2


def test_projector_parity(full):
    reference, _, dst, ours = full
    merged = run_ours(ours, pixels(IMAGES), IMAGES).pooler_output
    projector = MoonViTProjector.from_pretrained(dst)
    with torch.no_grad():
        expected = reference.model.mm_projector(merged).squeeze(1)
        got = projector(merged)
    assert got.shape == (merged.shape[0], 32)
    torch.testing.assert_close(got, expected, **TOL)
    with pytest.raises(ShapeError):
        projector(merged[:, :3])


def test_each_image_in_a_pack_equals_it_alone(full):
    *_, ours = full
    grids = IMAGES + [[8, 4, 4]]
    px = pixels(grids)
    pack = run_ours(ours, px, grids)
    start, merged_start = 0, 0
    for grid in grids:
        n = grid[0] * grid[1] * grid[2]
        alone = run_ours(ours, px[start:start + n], [grid])
        m = alone.pooler_output.shape[0]
        torch.testing.assert_close(pack.last_hidden_state[start:start + n], alone.last_hidden_state, **TOL)
        torch.testing.assert_close(pack.pooler_output[merged_start:merged_start + m], alone.pooler_output, **TOL)
        start, merged_start = start + n, merged_start + m


def test_converter_reads_only_vision_and_projector(full):
    _, src, dst, _ = full
    source_keys = set()
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            source_keys |= set(f.keys())
    assert len(list(src.glob("*.safetensors"))) > 1  # sharded source
    assert any("language_model" in k for k in source_keys)
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        ours = set(f.keys())
    assert ours == set(MoonViTModel(MoonViTConfig.from_pretrained(dst)).state_dict())
    with safe_open(str(dst / "projector.safetensors"), "pt") as f:
        assert set(f.keys()) == {f"{m}.{p}" for m in ("pre_norm", "mlp.fc1", "mlp.fc2") for p in ("weight", "bias")}
    config = MoonViTConfig.from_pretrained(dst)
    assert (config.projector_out_size, config.temporal_chunk_size, config.pos_emb_height) == (32, 4, 8)


def test_parity_from_bare_vision_model(tmp_path):
    """A `Kimi_K25VisionModel.save_pretrained` directory (transformers' own key names, no projector)."""
    config = hf_config.Kimi_K25VisionConfig(**VISION)
    config._attn_implementation = "sdpa"
    reference = hf_model.Kimi_K25VisionModel(config).eval()
    randomise(reference, seed=3)
    reference.save_pretrained(tmp_path / "src")
    dst = convert_kimi_k25_vision(tmp_path / "src", tmp_path / "dst")
    ours = MoonViTModel.from_pretrained(dst).eval()
    px = pixels(IMAGES)
    a, b = run_theirs(reference, px, [IMAGES]), run_ours(ours, px, IMAGES)
    torch.testing.assert_close(b.last_hidden_state, a.last_hidden_state, **TOL)
    torch.testing.assert_close(b.pooler_output, a.pooler_output, **TOL)
    assert not (dst / "projector.safetensors").exists()
    with pytest.raises(CheckpointError, match="no projector"):
        MoonViTProjector.from_pretrained(dst)



def test_converting_into_an_existing_folder_needs_overwrite_and_leaves_no_stale_projector(full, tmp_path):
    """A bare tower converted over a whole model's conversion: refused, then with `overwrite` replaced whole (the
    earlier projector.safetensors does not stay beside a tower it was not trained with)."""
    from kimi_vl.cli import main

    _, src, _, _ = full
    bare = hf_model.Kimi_K25VisionModel(hf_config.Kimi_K25VisionConfig(**VISION)).eval()
    bare.save_pretrained(tmp_path / "bare")
    dst = convert_kimi_k25_vision(src, tmp_path / "dst")
    assert (dst / "projector.safetensors").is_file()
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        convert_kimi_k25_vision(tmp_path / "bare", dst)
    assert (dst / "projector.safetensors").is_file()  # untouched
    assert main(["convert", "kimi-k25-vision", str(tmp_path / "bare"), str(dst), "--overwrite"]) in (None, 0)
    assert not (dst / "projector.safetensors").exists()
    with pytest.raises(CheckpointError, match="no projector"):
        MoonViTProjector.from_pretrained(dst)
    fresh = MoonViTModel.from_pretrained(convert_kimi_k25_vision(tmp_path / "bare", tmp_path / "fresh")).state_dict()
    assert all(torch.equal(t, fresh[k]) for k, t in MoonViTModel.from_pretrained(dst).state_dict().items())


def test_random_init_save_load_roundtrip(tmp_path):
    config = MoonViTConfig(**VISION)
    model = MoonViTModel(config).eval()
    model.save_pretrained(tmp_path)
    loaded = MoonViTModel.from_pretrained(tmp_path).eval()
    px = pixels([[1, 4, 4], [2, 2, 2]])
    torch.testing.assert_close(run_ours(loaded, px, [[1, 4, 4], [2, 2, 2]]).last_hidden_state,
                               run_ours(model, px, [[1, 4, 4], [2, 2, 2]]).last_hidden_state, rtol=0, atol=0)


def test_converter_errors(full, tmp_path):
    _, src, _, _ = full
    with pytest.raises(CheckpointError, match="config.json"):
        convert_kimi_k25_vision(tmp_path / "missing", tmp_path / "out")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type"):
        convert_kimi_k25_vision(wrong, tmp_path / "out")
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    (text_only / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointError, match="safetensors"):
        convert_kimi_k25_vision(text_only, tmp_path / "out")
    save_file({"language_model.model.embed_tokens.weight": torch.zeros(4, 4)}, str(text_only / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no vision"):
        convert_kimi_k25_vision(text_only, tmp_path / "out")
    save_file({"vision_tower.encoder.final_layernorm.weight": torch.zeros(64)}, str(text_only / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        convert_kimi_k25_vision(text_only, tmp_path / "out")


def test_converter_refuses_vision_tensors_it_does_not_recognise(full, tmp_path):
    """A vision-tower or projector tensor with no place in MoonViT-3D is named, as `convert_kimi_k25` names it, never
    dropped: the tower would compute without it."""
    _, src, _, _ = full
    extra = tmp_path / "extra"
    extra.mkdir()
    for f in src.iterdir():
        (extra / f.name).write_bytes(f.read_bytes())
    added = {"vision_tower.encoder.blocks.0.attn.q_norm.weight": torch.ones(16),
             "mm_projector.proj.1.weight": torch.ones(4)}
    save_file(added, str(extra / "extra.safetensors"))
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(added, "extra.safetensors"))
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"unrecognised vision-tower or projector tensors \['mm_projector\.proj"
                                              r"\.1\.weight', 'vision_tower\.encoder\.blocks\.0\.attn\.q_norm"):
        convert_kimi_k25_vision(extra, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(hidden_size=64, num_attention_heads=5),  # heads do not divide
        dict(hidden_size=72, num_attention_heads=4),  # head_dim 18 not a multiple of 4
        dict(merge_kernel_size=(2,)),
        dict(merge_kernel_size=(2, 0)),
        dict(hidden_act="relu"),
        dict(num_hidden_layers=0),
        dict(temporal_chunk_size=0),
        dict(layer_norm_eps=0.0),
        dict(projector_out_size=-1),
    ],
)
def test_config_errors(kwargs):
    with pytest.raises(ConfigError):
        MoonViTConfig(**{**VISION, **kwargs})


def test_projector_needs_output_size():
    with pytest.raises(ConfigError):
        MoonViTProjector.from_config(MoonViTConfig(**VISION))


@pytest.mark.parametrize(
    "px_shape, grids",
    [
        ((20, 3, 14, 14), [[1, 4, 4]]),  # patch count mismatch
        ((12, 3, 14, 14), [[1, 3, 4]]),  # h not divisible by the merge kernel
        ((16, 3, 14, 7), [[1, 4, 4]]),  # wrong patch size
        ((16, 3, 14, 14), [[4, 4]]),  # grid_thw not [n, 3]
        ((0, 3, 14, 14), [[0, 4, 4]]),  # t = 0
    ],
)
def test_forward_shape_errors(px_shape, grids):
    model = MoonViTModel(MoonViTConfig(**VISION))
    with pytest.raises(ShapeError):
        model(torch.zeros(px_shape), torch.tensor(grids))


def test_backward_and_gradient_checkpointing(full):
    *_, ours = full
    grids = [[1, 4, 6], [2, 2, 2]]
    px = pixels(grids)
    expected = run_ours(ours, px, grids).pooler_output  # inference path (in-place GELU)
    ours.train()
    try:
        out = ours(px, torch.tensor(grids)).pooler_output
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
        assert all(g.abs().sum() > 0 for g in grads.values())
        ours.zero_grad()
        ours.activation_checkpointing_enable()
        assert ours.gradient_checkpointing
        enabled, calls = ours._gradient_checkpointing_func, []  # the function the enable call chose runs each block
        ours._gradient_checkpointing_func = lambda fn, *a: calls.append(fn) or enabled(fn, *a)
        ours(px, torch.tensor(grids)).pooler_output.square().sum().backward()
        assert calls == list(ours.layers)
        for n, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    finally:
        ours.activation_checkpointing_disable()
        ours.zero_grad(set_to_none=True)
        ours.eval()
