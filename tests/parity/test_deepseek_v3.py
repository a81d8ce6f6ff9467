"""Parity of the RoPE-MLA configuration of our text backbone with transformers' `DeepseekV3ForCausalLM` (the text
model of Kimi K2 / K2.5): tiny random configs saved, converted with `convert_deepseek_v3`, loaded."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kimi_vl.convert import convert_deepseek_v3
from kimi_vl.errors import CheckpointError
from kimi_vl.text import KimiTextForCausalLM
from tests.vision.test_moonvit import randomise as randomise_parameters

YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 8, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}
CONFIGS = {
    # Kimi K2's layout: low-rank queries, YaRN with mscale on the softmax, interleaved rope rows, grouped routing,
    # attention biases, one dense layer first.
    "k2": dict(q_lora_rank=12, rope_parameters=YARN, max_position_embeddings=128, rope_interleave=True,
               n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
               first_k_dense_replace=1, attention_bias=True, routed_scaling_factor=2.5),
    # A full q_proj, plain RoPE, half-split rope rows, no grouping, no renormalisation, two dense layers.
    "plain": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 300.0},
                  rope_interleave=False, n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1,
                  n_shared_experts=1, first_k_dense_replace=2, norm_topk_prob=False, routed_scaling_factor=1.5),
    # transformers' defaults for num_key_value_heads (128, whatever the head count) and n_shared_experts=0
    # (zero-width shared experts).
    "no_shared_experts": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 300.0},
                              rope_interleave=True, num_key_value_heads=128, n_routed_experts=4, num_experts_per_tok=2,
                              n_group=1, topk_group=1, n_shared_experts=0, first_k_dense_replace=1),
}


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random (norms around 1, biases non-zero: the vision tests' rule) and the router correction
    biases too."""
    randomise_parameters(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.3 * torch.rand(m.e_score_correction_bias.shape, generator=gen) - 0.15)


def hf_model(name: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    cfg = DeepseekV3Config(**{
        **dict(vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
               num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12,
               v_head_dim=10, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        **CONFIGS[name],
    })
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomise(model, seed)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf")
    convert_deepseek_v3(root / "hf", root / "ours")
    return hf, KimiTextForCausalLM.from_pretrained(root / "ours").eval(), root


def padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 45), generator=g)  # 45 > original_max_position_embeddings of the YaRN config
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    mask[2, :20] = 0
    ids[mask == 0] = 0
    return ids, mask


@torch.no_grad()
def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    assert set(ours.config.layer_types) == {"mla_rope"}
    ids, mask = padded_batch()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    ref = hf(ids, attention_mask=mask, position_ids=positions).logits
    got = ours(ids, attention_mask=mask).logits  # positions derived from the mask
    valid = mask.bool()
    assert (got[valid] - ref[valid]).abs().max() < 1e-4
    assert ref[valid].std() > 0.5  # not a comparison of near-constant outputs
    # Padding does not move a row's positions: row 2 alone gives the same logits.
    alone = ours(ids[2:, 20:]).logits
    assert (alone[0] - got[2, 20:]).abs().max() < 1e-4


@torch.no_grad()
def test_greedy_generation_matches_transformers(pair):
    hf, ours, _ = pair
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, **kw)
    got = ours.generate(ids, **kw)  # the hybrid cache; decode steps take the absorbed latent path
    assert torch.equal(got, ref)


@torch.no_grad()
def test_absorbed_decode_equals_expanded(pair):
    """Decoding against the cache (absorbed weights, rotated cached keys) equals cache-free forwards."""
    _, ours, _ = pair
    ids, mask = padded_batch()
    full = ours(ids, attention_mask=mask, use_cache=False).logits[:, -4:]
    out = ours(ids[:, :-4], attention_mask=mask[:, :-4], use_cache=True)
    steps = []
    for t in range(4):
        pos = ids.shape[1] - 4 + t
        out = ours(ids[:, pos:pos + 1], attention_mask=mask[:, :pos + 1], cache=out.cache,
                   use_cache=True)
        steps.append(out.logits[:, -1])
    assert (torch.stack(steps, 1) - full).abs().max() < 1e-4


def test_packed_sequences_restart_positions(pair):
    _, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 97, (1, 11), generator=g), torch.randint(3, 97, (1, 17), generator=g)
    with torch.no_grad():
        packed = ours(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 11, 28])).logits
        assert (packed[:, 11:] - ours(b).logits).abs().max() < 1e-4
        assert (packed[:, :11] - ours(a).logits).abs().max() < 1e-4


def test_sharded_and_packed_expert_layouts(pair, tmp_path):
    """transformers' packed experts (`gate_up_proj` / `down_proj`) split across shards convert to the same model."""
    hf, ours, root = pair
    state = load_file(root / "hf" / "model.safetensors")
    packed = {}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        if f"{prefix}0.gate_proj.weight" not in state:
            continue
        n = hf.config.n_routed_experts
        gate_up = [torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"), state.pop(f"{prefix}{e}.up_proj.weight")])
                   for e in range(n)]
        packed[f"{prefix}gate_up_proj"] = torch.stack(gate_up)
        packed[f"{prefix}down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])
    state.update(packed)
    keys = sorted(state)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text((root / "hf" / "config.json").read_text())
    save_file({k: state[k] for k in keys[::2]}, tmp_path / "src" / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in keys[1::2]}, tmp_path / "src" / "model-00002-of-00002.safetensors")
    convert_deepseek_v3(tmp_path / "src", tmp_path / "dst", max_shard_bytes=100_000)
    assert (tmp_path / "dst" / "model.safetensors.index.json").is_file()
    again = KimiTextForCausalLM.from_pretrained(tmp_path / "dst")
    for (name, p), q in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name


def test_block_attnres_conversion_starts_equal(pair, tmp_path):
    hf, ours, root = pair
    convert_deepseek_v3(root / "hf", tmp_path / "attnres", residual="block_attnres", attnres_block_size=2)
    model = KimiTextForCausalLM.from_pretrained(tmp_path / "attnres").eval()
    assert model.config.residual == "block_attnres"
    ids, mask = padded_batch()
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = ours(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() < 1e-5


def test_bad_inputs_leave_nothing(pair, tmp_path):
    _, _, root = pair
    with pytest.raises(CheckpointError, match="config.json"):
        convert_deepseek_v3(tmp_path / "none", tmp_path / "out")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    with pytest.raises(CheckpointError, match="kimi_linear.*convert kimi-linear"):
        convert_deepseek_v3(other, tmp_path / "out")
    (other / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json cannot be read as JSON"):
        convert_deepseek_v3(other, tmp_path / "out")
    # A missing expert tensor is named.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((root / "hf" / "config.json").read_text())
    state = load_file(root / "hf" / "model.safetensors")
    victim = next(k for k in state if ".experts.1.up_proj" in k)
    del state[victim]
    save_file(state, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="expert 1's up_proj"):
        convert_deepseek_v3(broken, tmp_path / "out")
    # FP8 weights without scale tensors, or GPTQ's packed integers, are quantized too: refused with what to do.
    for name, quantized in (("weight", state[victim.replace("up_proj", "gate_proj")].to(torch.float8_e4m3fn)),
                            ("qweight", torch.zeros(3, 24, dtype=torch.int32))):
        state[victim.replace("weight", name)] = quantized
        save_file(state, broken / "model.safetensors")
        with pytest.raises(CheckpointError, match="holds quantized tensors.*Dequantize the checkpoint"):
            convert_deepseek_v3(broken, tmp_path / "out")
        del state[victim.replace("weight", name)]
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
