"""RoPE-MLA layers (`"mla_rope"`): rotary frequencies against transformers' rope functions, any mix of KDA / NoPE-MLA /
RoPE-MLA layers with the hybrid cache and `generate`, QK-Clip's K2 rule on rotated heads, config errors."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from kimi_vl.errors import ConfigError, ShapeError
from kimi_vl.text import KimiHybridCache
from kimi_vl.text.mla import MultiHeadLatentAttention
from kimi_vl.text.rope import rope_frequencies, softmax_scale_multiplier
from kimi_vl.training import MuonClip

from .test_model import tiny_config, tiny_model

ROPES = {
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "yarn_k2": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "yarn_plain": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 3.0, "original_max_position_embeddings": 40,
                   "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "rope_theta": 900.0, "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 50},
    "linear": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.5},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_frequencies_and_softmax_scale_match_transformers(name):
    params = ROPES[name]
    ref_cfg = DeepseekV3Config(qk_rope_head_dim=16, rope_parameters=dict(params), max_position_embeddings=512)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](ref_cfg)
    inv, factor = rope_frequencies(params, 16, 512)
    assert torch.equal(inv, ref_inv)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    assert softmax_scale_multiplier(params, 512) == pytest.approx(yarn_apply_mscale(params, 1.0), rel=1e-12)
    assert not torch.equal(inv, rope_frequencies({"rope_type": "default", "rope_theta": params["rope_theta"]}, 16)[0])


@torch.no_grad()
@pytest.mark.parametrize("layer_types", [["kda", "mla_rope", "mla", "mla_rope"], ["mla_rope", "kda", "kda", "mla"]])
def test_any_mix_decodes_with_the_hybrid_cache(layer_types):
    model = tiny_model(layer_types=layer_types, rope_parameters=ROPES["yarn"], max_position_embeddings=512,
                       q_lora_rank=10, attention_bias=True, n_group=2, topk_group=1)
    ids = torch.randint(3, 61, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    full = model(ids, attention_mask=mask, use_cache=False).logits
    cache = KimiHybridCache(model.config)
    step = model(ids[:, :34], attention_mask=mask[:, :34], cache=cache).logits
    assert (step - full[:, :34])[mask[:, :34].bool()].abs().max() < 1e-4
    for t in range(34, 40):  # recurrent KDA, absorbed NoPE and RoPE MLA against rotated cached keys
        step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits
        assert (step[:, 0] - full[:, t]).abs().max() < 1e-4
    # generate (greedy, padded batch) equals repeated cache-free forwards
    out = model.generate(ids[:, :30], attention_mask=mask[:, :30], max_new_tokens=5, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    seq, m = ids[:, :30], mask[:, :30]
    for _ in range(5):
        nxt = model(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(out, seq)
    n_mla = sum(t != "kda" for t in layer_types)
    assert model.model.cache_bytes_per_token(10**9) == pytest.approx(n_mla * (12 + 4) * 4, rel=1e-3)


def test_rope_layers_see_positions_and_nope_layers_do_not():
    rope = tiny_model(layer_types=["mla_rope"] * 2, num_hidden_layers=2)
    nope = tiny_model(layer_types=["mla"] * 2, num_hidden_layers=2)
    nope.load_state_dict(rope.state_dict())
    ids = torch.randint(3, 61, (1, 12))
    with torch.no_grad():
        shifted = torch.arange(5, 17)[None]
        # Rotary attention depends on relative positions only: a constant shift changes nothing...
        torch.testing.assert_close(rope(ids, position_ids=shifted).logits, rope(ids).logits, rtol=0, atol=1e-5)
        # ...but other relative positions do, and RoPE differs from NoPE.
        assert (rope(ids, position_ids=torch.arange(12)[None] * 3).logits - rope(ids).logits).abs().max() > 1e-3
        assert (rope(ids).logits - nope(ids).logits).abs().max() > 1e-3
        assert torch.equal(nope(ids, position_ids=torch.arange(12)[None] * 3).logits, nope(ids).logits)
    with pytest.raises(ShapeError, match="position_ids"):
        rope(ids, position_ids=torch.arange(5)[None])
    with pytest.raises(ShapeError, match="rope="):
        rope.model.layers[0].self_attn(torch.randn(1, 3, 32))


def test_gradient_checkpointing_with_rope():
    model = tiny_model(layer_types=["kda", "mla_rope"] * 2, num_hidden_layers=4).train()
    ids = torch.randint(3, 61, (2, 20))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)


def _rope_scores(mla, x):
    """Every pair's logit `[B, h, T, T]` from the weights (rotated q_pe and shared k_pe)."""
    positions = torch.arange(x.shape[1])[None]
    from kimi_vl.text.rope import RotaryEmbedding

    rope = RotaryEmbedding(ROPES["yarn_attention_factor"], mla.rope_dim)(positions, x.dtype)
    with torch.no_grad():
        q_nope, q_pe = mla.queries(x, rope)
        c, k_pe = mla.latent(x, rope).split([mla.rank, mla.rope_dim], dim=-1)
        w_uk, _ = mla._kv_weights()
        k_nope = torch.einsum("btr,hnr->bhtn", c, w_uk)
        return (q_nope @ k_nope.mT + q_pe @ k_pe[:, None].mT) * mla.scale, rope


def test_qk_clip_k2_rule_is_exact_on_rope_heads():
    """q_nope / k_nope by sqrt(gamma), q_rope by gamma, shared rotary key untouched: the clipped heads' logits scale by
    exactly gamma (rotation and YaRN's attention factor are linear per token), the others do not move."""
    config = tiny_config(layer_types=["mla_rope"], num_hidden_layers=1, num_attention_heads=4, q_lora_rank=10,
                         rope_parameters=ROPES["yarn_attention_factor"], attention_bias=True)
    mla = MultiHeadLatentAttention(config, 0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in mla.parameters():
            torch.nn.init.normal_(p, std=0.3)
        mla.q_b_proj.weight.view(4, 12, -1)[[0, 2]] *= 6
    x = torch.randn(2, 10, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    before, rope = _rope_scores(mla, x)
    s = before.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    tau = float((s[[0, 2]].min() + s[[1, 3]].max()) / 2)
    assert s[[1, 3]].max() < tau < s[[0, 2]].min()
    opt = MuonClip(mla, lr=0.0, qk_clip_tau=tau)
    k_rope_rows = mla.kv_a_proj_with_mqa.weight[config.kv_lora_rank:].clone()
    mla(x, rope=rope)
    opt.step()  # no gradients: only QK-Clip acts
    torch.testing.assert_close(opt.last_max_logits[""], s, rtol=1e-5, atol=1e-5)
    after, _ = _rope_scores(mla, x)
    gamma = tau / s
    for h in (0, 2):
        torch.testing.assert_close(after[:, h], gamma[h] * before[:, h], rtol=1e-4, atol=1e-5)
    assert torch.equal(after[:, [1, 3]], before[:, [1, 3]])
    assert torch.equal(mla.kv_a_proj_with_mqa.weight[config.kv_lora_rank:], k_rope_rows)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layer_types=["mla_rope"] * 4, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(layer_types=["mla_rope"] * 4, qk_rope_head_dim=5), "even"),
    (dict(layer_types=["mla_rope"] * 4, rope_parameters={"rope_type": "yarn", "factor": 2.0}),
     "original_max_position_embeddings"),
    (dict(layer_types=["mla_rope"] * 4, rope_parameters={"rope_type": "linear"}), "factor"),
    (dict(num_experts=4, n_group=4, topk_group=1), "fewer than 2"),
    (dict(layer_types=["kda", "rope"] * 2), "layer_types"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**kwargs)


def test_config_round_trip_and_aliases(tmp_path):
    config = tiny_config(layer_types=["mla_rope", "kda", "mla", "kda"], first_k_dense_replace=2,
                         rope_theta=777.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 16})
    assert config.first_k_dense == 2 and config.rope_parameters["rope_theta"] == 777.0
    config.save_pretrained(tmp_path)
    again = type(config).from_pretrained(tmp_path)
    assert again.rope_parameters == config.rope_parameters and again.first_k_dense == 2
    assert tiny_config().rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert tiny_config().max_position_embeddings is None  # no context limit declared (eval reads it)
