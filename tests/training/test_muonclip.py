"""MuonClip: Newton-Schulz, RMS matching, parity with torch.optim.Muon / AdamW, routing, QK-Clip, max-logit recording."""

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

from kimi_vl.text.mla import MultiHeadLatentAttention
from kimi_vl.text.moe import Experts
from kimi_vl.training import MuonClip, zeropower_via_newtonschulz
from tests.text.test_model import tiny_config, tiny_model

# ---------------------------------------------------------------- Muon


def test_newton_schulz_spectrum_rectangular():
    for shape in [(256, 128), (128, 256)]:
        sv = torch.linalg.svdvals(zeropower_via_newtonschulz(torch.randn(*shape)))
        assert sv.min() > 0.5 and sv.max() < 1.5


def test_newton_schulz_batched_equals_per_matrix_and_scale_invariant():
    g = torch.randn(3, 24, 40)
    batched = zeropower_via_newtonschulz(g)
    for e in range(3):
        torch.testing.assert_close(batched[e], zeropower_via_newtonschulz(g[e]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(zeropower_via_newtonschulz(0.05 * g), batched, rtol=1e-4, atol=1e-5)


def test_update_rms_matches_adamw():
    lin = nn.Linear(128, 256, bias=False)
    opt = MuonClip(lin, lr=1e-2, weight_decay=0.0)
    before = lin.weight.detach().clone()
    lin.weight.grad = torch.randn_like(lin.weight)
    opt.step()
    rms = ((lin.weight - before) / 1e-2).pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.22


def _fp32_ns(grad, ns_coefficients, ns_steps, eps):
    return zeropower_via_newtonschulz(grad, ns_steps, eps, dtype=torch.float32)


@pytest.mark.parametrize("nesterov", [True, False])
def test_two_steps_equal_torch_muon(monkeypatch, nesterov):
    """Same settings (lr, wd, momentum, nesterov, 5 NS steps, adjust_lr_fn="match_rms_adamw"). torch runs NS in
    bf16; with its NS swapped for fp32 the two agree to fp32 rounding, unpatched to bf16 accuracy."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(48, 32, bias=False), nn.Linear(32, 80, bias=False))
    grads = [[torch.randn_like(p) for p in ref.parameters()] for _ in range(2)]

    def run(make_opt):
        model = nn.Sequential(nn.Linear(48, 32, bias=False), nn.Linear(32, 80, bias=False))
        model.load_state_dict(ref.state_dict())
        opt = make_opt(model)
        for gs in grads:
            for p, g in zip(model.parameters(), gs):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in model.parameters()]

    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    ours = run(lambda m: MuonClip(m, **kw))
    theirs_bf16 = run(lambda m: torch.optim.Muon(m.parameters(), adjust_lr_fn="match_rms_adamw", **kw))
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_ns)
    theirs_fp32 = run(lambda m: torch.optim.Muon(m.parameters(), adjust_lr_fn="match_rms_adamw", **kw))
    for a, b, c, p0 in zip(ours, theirs_fp32, theirs_bf16, ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        step = (b - p0.detach()).abs().max()
        assert (a - c).abs().max() < 0.05 * step


def test_adamw_group_equals_torch_adamw():
    torch.manual_seed(0)
    ref = nn.LayerNorm(16)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    a, b = nn.LayerNorm(16), nn.LayerNorm(16)
    a.load_state_dict(ref.state_dict())
    b.load_state_dict(ref.state_dict())
    ours = MuonClip(a, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        for pa, pb in zip(a.parameters(), b.parameters()):
            g = torch.randn_like(pa)
            pa.grad, pb.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_stacked_experts_are_orthogonalised_per_expert():
    experts = Experts(3, 16, 40)
    for w in experts.parameters():
        nn.init.normal_(w, std=0.1)
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in experts.named_parameters()}
    for n, p in experts.named_parameters():
        p.grad = grads[n].clone()
    opt = MuonClip(experts, lr=0.01, weight_decay=0.1, nesterov=False)
    assert set(opt.routing().values()) == {"muon"}
    opt.step()
    for n, p in experts.named_parameters():
        for e in range(3):
            g = grads[n][e] * 0.05  # EMA momentum after one step, nesterov off
            A, B = g.shape
            expected = before[n][e] * (1 - 0.01 * 0.1) - 0.01 * 0.2 * max(A, B) ** 0.5 * zeropower_via_newtonschulz(g)
            torch.testing.assert_close(p[e], expected, rtol=1e-5, atol=1e-6)


def test_bf16_momentum_buffer_is_not_normalised_in_place():
    lin = nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    opt = MuonClip(lin, lr=1e-3, nesterov=False)
    g = torch.randn_like(lin.weight) * 10
    lin.weight.grad = g
    opt.step()
    buf = opt.state[lin.weight]["momentum_buffer"]
    torch.testing.assert_close(buf.float(), (0.05 * g).float(), rtol=2e-2, atol=1e-3)
    assert buf.float().norm() > 5


# ---------------------------------------------------------------- routing


def test_routing_of_the_text_model():
    model = tiny_model()
    opt = MuonClip(model, lr=1e-3)
    routes = opt.routing()
    assert len(routes) == len(list(model.parameters()))
    adamw = [n for n, k in routes.items() if k == "adamw"]
    muon = [n for n, k in routes.items() if k == "muon"]
    for must in ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.A_log",
                 "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.q_conv1d.weight",
                 "model.layers.0.self_attn.o_norm.weight", "model.layers.3.self_attn.kv_a_layernorm.weight"]:
        assert routes[must] == "adamw", must
    assert any(n.startswith("model.residual.") for n in adamw)
    assert all(routes[n] == "adamw" for n in routes if n.startswith("model.residual."))
    for must in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.f_b_proj.weight",
                 "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.3.self_attn.o_proj.weight", "model.layers.1.mlp.experts.w1",
                 "model.layers.1.mlp.experts.w2", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight"]:
        assert routes[must] == "muon", must
    assert all(p.ndim in (2, 3) for n, p in model.named_parameters() if n in muon)
    kinds = {g["kind"]: len(g["params"]) for g in opt.param_groups}
    assert kinds == {"muon": len(muon), "adamw": len(adamw)}


def test_tied_embedding_is_routed_once():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    opt = MuonClip(model, lr=1e-3)
    routes = opt.routing()
    assert routes["model.embed_tokens.weight"] == "adamw" and "lm_head.weight" not in routes
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


# ---------------------------------------------------------------- QK-Clip and max logits


def _mla(seed=0, heads=4, **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(num_attention_heads=heads, **kw)
    mla = MultiHeadLatentAttention(cfg, 0)
    for p in mla.parameters():
        if p.ndim == 2:
            nn.init.normal_(p, std=0.3)
    return mla


def _scores(mla, x):
    """Every pair's logit `[B, h, T, T]` (fp32), computed from the weights, no mask."""
    with torch.no_grad():
        q_nope, q_pe = mla.queries(x)
        c, k_pe = mla.latent(x).split([mla.rank, mla.rope_dim], dim=-1)
        w_uk, _ = mla._kv_weights()
        k_nope = torch.einsum("btr,hnr->bhtn", c, w_uk)
        return (q_nope @ k_nope.mT + q_pe @ k_pe[:, None].mT) * mla.scale


def _causal():
    return lambda T, L: torch.ones(T, L, dtype=torch.bool).tril()


@pytest.mark.parametrize("q_lora_rank", [None, 10])
def test_qk_clip_is_exact_on_mla_heads(q_lora_rank):
    mla = _mla(q_lora_rank=q_lora_rank)
    with torch.no_grad():  # boost heads 0 and 2 so they clip, heads 1 and 3 do not
        qp = mla.q_proj if q_lora_rank is None else mla.q_b_proj
        qp.weight.view(4, 12, -1)[[0, 2]] *= 6
    x = torch.randn(2, 10, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    before = _scores(mla, x)
    s = before.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    tau = float((s[[0, 2]].min() + s[[1, 3]].max()) / 2)
    assert s[[1, 3]].max() < tau < s[[0, 2]].min()
    opt = MuonClip(mla, lr=0.0, qk_clip_tau=tau)
    untouched = {n: p.detach().clone() for n, p in mla.named_parameters() if "q_" not in n and "kv_b" not in n}
    v_rows = mla.kv_b_proj.weight.view(4, 16, -1)[:, 8:].clone()
    mla(x)
    opt.step()  # no gradients: only QK-Clip acts
    torch.testing.assert_close(opt.last_max_logits[""], s, rtol=1e-6, atol=1e-6)
    after = _scores(mla, x)
    gamma = tau / s
    s_after = after.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(s_after[[0, 2]], torch.full((2,), tau), rtol=1e-5, atol=0)
    assert torch.equal(after[:, [1, 3]], before[:, [1, 3]])
    for h in (0, 2):
        torch.testing.assert_close(after[:, h], gamma[h] * before[:, h], rtol=1e-5, atol=1e-5)
    assert torch.equal(mla.kv_b_proj.weight.view(4, 16, -1)[:, 8:], v_rows)
    for n, p in mla.named_parameters():
        if n in untouched:
            assert torch.equal(p, untouched[n]), n
    assert mla.max_logits is None  # reset after the step


def test_scaling_shared_k_rope_would_leak_into_other_heads():
    """Negative control: the shared rotary key is used by every head, which is why QK-Clip leaves it alone."""
    mla = _mla()
    x = torch.randn(1, 6, 32)
    before = _scores(mla, x)
    with torch.no_grad():
        mla.kv_a_proj_with_mqa.weight[mla.rank :] *= 0.5
    after = _scores(mla, x)
    assert all(not torch.equal(after[:, h], before[:, h]) for h in range(4))


def test_masked_future_logit_does_not_trigger_clipping():
    mla = _mla(heads=2)  # q_proj [24, 32] has a null space: a token there has a zero query
    T = 8
    x = torch.randn(1, T, 32)
    with torch.no_grad():
        wq = mla.q_proj.weight
        null = torch.linalg.svd(wq, full_matrices=True).Vh[wq.shape[0] :]  # [8, 32], wq @ null.T == 0
        q_pe0 = mla.queries(x[:, :1])[1][0, 0, 0]  # head 0's rotary query of token 0
        w_kpe = mla.kv_a_proj_with_mqa.weight[mla.rank :]
        direction = null.T @ (null @ (w_kpe.T @ q_pe0))
        x[0, -1] = 200 * direction / direction.norm()
    full = _scores(mla, x)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed_max = full.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    tau = float(allowed_max.max()) + 1.0
    assert full[0, 0, 0, -1] > 10 * tau  # the future pair (query 0, key T-1) is huge
    opt = MuonClip(mla, lr=0.0, qk_clip_tau=tau)
    weights = {n: p.detach().clone() for n, p in mla.named_parameters()}
    mla(x)
    opt.step()
    torch.testing.assert_close(opt.last_max_logits[""], allowed_max, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p, weights[n]) for n, p in mla.named_parameters())


def test_recorded_max_logits_equal_explicit_masked_scores():
    mla = _mla()
    mla.record_max_logits = True
    # plain causal
    x = torch.randn(2, 12, 32)
    mla(x)
    want = _scores(mla, x).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(mla.max_logits, want.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    # explicit boolean mask (left padding of row 1, every row keeps itself)
    mla.max_logits = None
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    mask[1, :, :, :5] = False
    mask[1, 0, torch.arange(5), torch.arange(5)] = True
    mla(x, attn_mask=mask)
    want = _scores(mla, x).masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(mla.max_logits, want, rtol=1e-5, atol=1e-5)
    # packed sequences: no pair across a boundary
    mla.max_logits = None
    xp = torch.randn(1, 12, 32)
    cu = torch.tensor([0, 5, 12])
    mla(xp, cu_seqlens=cu)
    seg = torch.zeros(12, dtype=torch.long)
    seg[5:] = 1
    packed = torch.ones(12, 12, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
    want = _scores(mla, xp).masked_fill(~packed, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(mla.max_logits, want, rtol=1e-5, atol=1e-5)
    # accumulation across forwards is an element-wise max
    first = mla.max_logits.clone()
    mla(x)
    causal_max = _scores(mla, x).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(mla.max_logits, torch.maximum(first, causal_max.amax(dim=(0, 2, 3))),
                               rtol=1e-5, atol=1e-5)
    assert (mla.max_logits >= first).all()


def test_recording_in_query_blocks(monkeypatch):
    import kimi_vl.text.mla as mla_mod

    mla = _mla()
    mla.record_max_logits = True
    x = torch.randn(2, 20, 32)
    mla(x)
    whole = mla.max_logits
    monkeypatch.setattr(mla_mod, "MAX_LOGIT_BLOCK_ELEMENTS", 2 * 4 * 20 * 3)  # 3 query rows per block
    mla.max_logits = None
    mla(x)
    torch.testing.assert_close(mla.max_logits, whole, rtol=1e-6, atol=1e-6)


def test_recorded_max_logit_in_absorbed_decode_path():
    mla = _mla()
    mla.record_max_logits = True
    x = torch.randn(1, 9, 32)
    q_nope, q_pe = mla.queries(x[:, -1:])
    with torch.no_grad():
        mla._absorbed(q_nope, q_pe, mla.latent(x), None)
    want = _scores(mla, x)[:, :, -1].amax(dim=(0, 2))
    torch.testing.assert_close(mla.max_logits, want, rtol=1e-5, atol=1e-5)


def test_recording_off_by_default_and_output_unchanged():
    mla = _mla()
    x = torch.randn(1, 7, 32)
    out = mla(x)
    assert mla.max_logits is None
    mla.record_max_logits = True
    assert torch.equal(mla(x), out)


def test_tiny_model_trains_with_muonclip():
    model = tiny_model().train()
    opt = MuonClip(model, lr=3e-3, qk_clip_tau=100.0)
    ids = torch.randint(3, 61, (4, 24))
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
    assert list(opt.last_max_logits) == ["model.layers.3.self_attn"]
    assert opt.last_max_logits["model.layers.3.self_attn"].shape == (2,)
    assert all(torch.isfinite(p).all() for p in model.parameters())
