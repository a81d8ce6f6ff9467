"""MuonClip: Newton-Schulz, RMS matching, parity with torch.optim.Muon / AdamW, routing (declared by modules), QK-Clip
(MLA, MoonViT's MHA and any `QKClipTarget`), max-logit recording and the shared blockwise helper, accumulation over
micro-batches and ranks, step discarding, the import boundary, and the logit-explosion integration test."""

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.optim._muon as torch_muon
from timm.layers import apply_rot_embed
from torch import nn

import kimi_vl.kernels.attention as attention_mod
import kimi_vl.training.muonclip as muonclip_mod
from kimi_vl.errors import ConfigError
from kimi_vl.kernels import max_logits, packed_max_logits
from kimi_vl.optim_contract import ADAMW, MUON, MUON_BATCHED, QKClipTarget, parameter_routes
from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.text.mla import MultiHeadLatentAttention
from kimi_vl.text.moe import Experts
from kimi_vl.training import MuonClip, route_parameters, zeropower_via_newtonschulz
from kimi_vl.vision import MoonViTConfig
from kimi_vl.vision.moonvit import MoonViTAttention, MoonViTRotaryEmbedding, build_layout
from tests.test_modeling import IMG, image, sample, tiny_vl
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


def test_positional_lr_and_weight_decay():
    """`MuonClip(model, lr, weight_decay)` as DESIGN.md and `torch.optim.Muon(params, lr, weight_decay)` take them."""
    opt = MuonClip(nn.Linear(8, 8), 0.02, 0.05)
    assert {(g["lr"], g["weight_decay"]) for g in opt.param_groups} == {(0.02, 0.05)}


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


@pytest.mark.parametrize("batch_elements", [1 << 22, 2 * 40 * 24])  # one batch of 3; batches of 2 and 1
def test_same_shape_matrices_orthogonalised_together_equal_one_at_a_time(monkeypatch, batch_elements):
    """MuonClip runs batched Newton-Schulz over same-shape matrices: three of them in one model get the updates
    each gets alone."""
    monkeypatch.setattr(muonclip_mod, "NS_BATCH_ELEMENTS", batch_elements)
    torch.manual_seed(0)
    layers = [nn.Linear(24, 40, bias=False) for _ in range(3)]
    grads = [[torch.randn(40, 24) for _ in layers] for _ in range(2)]

    def run(params, which):
        opt = MuonClip(nn.ParameterList(params), lr=0.02, weight_decay=0.1)
        for gs in grads:
            for p, g in zip(params, [gs[i] for i in which], strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    together = run([nn.Parameter(layer.weight.detach().clone()) for layer in layers], [0, 1, 2])
    for i, layer in enumerate(layers):
        alone = run([nn.Parameter(layer.weight.detach().clone())], [i])[0]
        assert not torch.equal(alone, layer.weight)
        torch.testing.assert_close(together[i], alone, rtol=1e-6, atol=1e-7)


def test_same_shape_matrices_on_different_devices_are_orthogonalised_apart():
    """A model split over devices (`device_map`, offloading): same-shape matrices on two devices are not stacked
    into one batched Newton-Schulz (the meta device stands in for a second device on a CPU-only machine)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))
    alone = copy.deepcopy(model[0])
    model[1].to("meta")
    grad = torch.randn(6, 6)
    model[0].weight.grad, alone.weight.grad = grad.clone(), grad.clone()
    model[1].weight.grad = torch.empty(6, 6, device="meta")
    MuonClip(model, lr=0.02).step()
    MuonClip(alone, lr=0.02).step()
    assert torch.equal(model[0].weight, alone.weight)


def test_add_param_group_for_adapters_added_after_construction():
    """LoRA-style matrices added after the optimizer was built: `add_param_group` with a `kind` gives them the
    updates they get when routed at construction; a group without a kind, or a vector in a Muon group, is refused
    with a ConfigError."""
    torch.manual_seed(0)
    base = nn.Linear(8, 8)
    lora = nn.Sequential(nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False))
    ref = copy.deepcopy(nn.ModuleList([base, lora]))
    opt = MuonClip(base, lr=0.02)
    with pytest.raises(ConfigError, match="kind"):
        opt.add_param_group({"params": lora.parameters()})
    with pytest.raises(ConfigError, match=r"\(8,\)"):
        opt.add_param_group({"params": [base.bias], "kind": "muon"})
    opt.add_param_group({"params": lora.parameters(), "kind": "muon"})  # a one-shot iterator, as in torch
    assert [g["kind"] for g in opt.param_groups] == ["muon", "adamw", "muon"]
    assert opt.param_groups[2]["lr"] == 0.02 and len(opt.param_groups[2]["params"]) == 2
    ref_opt = MuonClip(ref, lr=0.02)
    x = torch.randn(4, 8)
    for _ in range(2):
        for (b, a), o in (((base, lora), opt), ((ref[0], ref[1]), ref_opt)):
            (b(x) + a(x)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip([*base.parameters(), *lora.parameters()], ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_parameters_instead_of_the_model_raise_config_error():
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="MuonClip\\(model, lr\\)"):
        MuonClip(model.parameters(), lr=1e-3)


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


class DeclaredRoutes(nn.Module):
    """A module kind MuonClip has never heard of, declaring some routes and leaving others to the default."""

    optimizer_routes = {"stack": MUON_BATCHED, "table": ADAMW, "inner": ADAMW}

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Parameter(torch.randn(3, 8, 5))  # three independent matrices
        self.table = nn.Parameter(torch.randn(8, 8))  # a 2-D matrix declared AdamW
        self.plain = nn.Parameter(torch.randn(6, 8))  # undeclared matrix: Muon
        self.cube = nn.Parameter(torch.randn(2, 3, 4))  # undeclared 3-D: AdamW
        self.emb = nn.Embedding(5, 8)  # undeclared embedding: AdamW
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # declared AdamW as a whole...
        self.inner[1].optimizer_routes = {"weight": MUON}  # ...but its second layer's own declaration wins


def test_modules_declare_their_routes_and_the_most_specific_declaration_wins():
    model = DeclaredRoutes()
    assert parameter_routes(model) == {
        "stack": MUON_BATCHED, "table": ADAMW, "plain": MUON, "cube": ADAMW, "emb.weight": ADAMW,
        "inner.0.weight": ADAMW, "inner.0.bias": ADAMW, "inner.1.weight": MUON, "inner.1.bias": ADAMW}
    opt = MuonClip(model, lr=0.01, weight_decay=0.0, nesterov=False)
    assert opt.routing() == {"stack": "muon", "table": "adamw", "plain": "muon", "cube": "adamw",
                             "emb.weight": "adamw", "inner.0.weight": "adamw", "inner.0.bias": "adamw",
                             "inner.1.weight": "muon", "inner.1.bias": "adamw"}
    # declarations live on modules, so copies (which drop attributes of parameter tensors) keep them
    assert MuonClip(copy.deepcopy(model), lr=0.01).routing() == opt.routing()
    before = model.stack.detach().clone()
    grad = torch.randn_like(model.stack)
    model.stack.grad = grad.clone()
    opt.step()
    for e in range(3):  # each [8, 5] slice is its own Muon matrix
        want = before[e] - 0.01 * 0.2 * 8**0.5 * zeropower_via_newtonschulz(0.05 * grad[e])
        torch.testing.assert_close(model.stack[e], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("label, shape", [("sgd", (4, 4)), (MUON, (4,)), (MUON, (2, 4, 4)), (MUON_BATCHED, (4, 4))])
def test_a_route_that_does_not_fit_raises_config_error(label, shape):
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(shape))
    module.optimizer_routes = {"w": label}
    with pytest.raises(ConfigError, match=label):
        MuonClip(module, lr=1e-3)


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


def test_recorded_max_logits_of_packed_rows_cover_every_row():
    mla = _mla()
    mla.record_max_logits = True
    x = torch.randn(2, 12, 32)
    x[1] *= 3  # the second row holds the larger logits
    mla(x, cu_seqlens=torch.tensor([0, 5, 12]))
    seg = (torch.arange(12) >= 5).long()
    packed = torch.ones(12, 12, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
    want = _scores(mla, x).masked_fill(~packed, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(mla.max_logits, want, rtol=1e-5, atol=1e-5)


def test_recording_in_query_blocks(monkeypatch):
    mla = _mla()
    mla.record_max_logits = True
    x = torch.randn(2, 20, 32)
    mla(x)
    whole = mla.max_logits
    monkeypatch.setattr(attention_mod, "MAX_LOGIT_BLOCK_ELEMENTS", 4 * 20 * 3)  # 3 query rows of one sample
    mla.max_logits = None
    mla(x)
    torch.testing.assert_close(mla.max_logits, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [None, 1, 3 * 9 * 2, 3 * 5 * 9 * 2])  # whole, 1 row, 2 rows, 2 samples per block
def test_max_logits_helper_equals_explicit_masked_scores(monkeypatch, block):
    """The shared helper on `[B, h, T, L]`: causal top-left with more keys than queries, a boolean mask broadcast
    over the batch and heads, and no mask; blocks of query rows and of batch elements change nothing."""
    if block is not None:
        monkeypatch.setattr(attention_mod, "MAX_LOGIT_BLOCK_ELEMENTS", block)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 3, 5, 6, generator=gen), torch.randn(4, 3, 9, 6, generator=gen)
    full = q @ k.mT * 0.7  # [4, 3, 5, 9]
    causal = torch.ones(5, 9, dtype=torch.bool).tril()
    mask = torch.rand(1, 1, 5, 9, generator=gen) > 0.5
    mask[..., 0] = True
    for got, allowed in [(max_logits(q, k, 0.7, causal=True), causal), (max_logits(q, k, 0.7, mask=mask), mask),
                         (max_logits(q, k, 0.7), torch.ones(5, 9, dtype=torch.bool))]:
        torch.testing.assert_close(got, full.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)),
                                   rtol=1e-6, atol=1e-6)


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


def test_bad_settings_raise_config_error():
    lin = nn.Linear(4, 4)
    for kw in [dict(qk_clip_tau=0.0), dict(qk_clip_tau=float("nan")), dict(ns_steps=0), dict(momentum=1.0)]:
        with pytest.raises(ConfigError):
            MuonClip(lin, lr=1e-3, **kw)


def test_every_non_matrix_and_every_pseudo_query_goes_to_adamw():
    model = tiny_model(residual="block_attnres")
    opt = MuonClip(model, lr=1e-3)
    routes = opt.routing()
    muon = {id(p) for g in opt.param_groups if g["kind"] == "muon" for p in g["params"]}
    for name, p in model.named_parameters():
        if p.ndim != 2 and not name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            assert routes[name] == "adamw" and id(p) not in muon, name
        if name.startswith("model.residual."):
            assert routes[name] == "adamw" and id(p) not in muon, name
    assert any(name.startswith("model.residual.") for name in routes)


# ---------------------------------------------------------------- MoonViT (MHA) max logits and QK-Clip

VIT = MoonViTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32,
                    pos_emb_height=8, pos_emb_width=8)
# two adjacent 4-token images, two adjacent 8-token segments (an image and a 2-frame chunk), one more image
CHUNKS = [(1, 2, 2), (1, 2, 2), (1, 2, 4), (2, 2, 2), (1, 2, 2)]


def _vit(seed=0):
    torch.manual_seed(seed)
    attn = MoonViTAttention(VIT)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn


def _vit_inputs(chunks=CHUNKS, seed=1):
    layout = build_layout(chunks, torch.device("cpu"))
    x = torch.randn(int(layout.cu_seqlens[-1]), VIT.hidden_size, generator=torch.Generator().manual_seed(seed))
    return x, layout.cu_seqlens, MoonViTRotaryEmbedding(VIT)(layout)


def _vit_pair_scores(attn, x, rope):
    """Every pair's logit `[h, N, N]` over the whole pack (cross-segment pairs included), fp32."""
    with torch.no_grad():
        q, k, _ = attn.qkv(x).view(x.shape[0], 3, attn.num_heads, attn.head_dim).unbind(1)
        q, k = (apply_rot_embed(t, *rope, half=True) for t in (q, k))
        return torch.einsum("ihd,jhd->hij", q, k) * attn.head_dim**-0.5


def _same_segment(cu):
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    return seg[:, None] == seg[None, :]


def _vit_max(attn, x, cu, rope):
    return _vit_pair_scores(attn, x, rope).masked_fill(~_same_segment(cu), float("-inf")).amax(dim=(1, 2))


@pytest.mark.parametrize("block", [None, 4 * 8 * 3, 4 * 4 * 4 * 2, 1])
def test_packed_max_logits_equal_explicit_block_diagonal_scores(monkeypatch, block):
    if block is not None:  # row blocks inside a segment, several segments per block, one score per block
        monkeypatch.setattr(attention_mod, "MAX_LOGIT_BLOCK_ELEMENTS", block)
    q, k = torch.randn(2, 28, 4, 8).unbind(0)
    cu = torch.tensor([0, 4, 4, 8, 16, 24, 28], dtype=torch.int32)  # one empty segment
    want = (torch.einsum("ihd,jhd->hij", q, k) * 0.3).masked_fill(~_same_segment(cu), float("-inf"))
    torch.testing.assert_close(packed_max_logits(q, k, cu, 0.3), want.amax(dim=(1, 2)), rtol=1e-6, atol=1e-6)
    causal = want.masked_fill(~torch.ones(28, 28, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(packed_max_logits(q, k, cu, 0.3, causal=True), causal.amax(dim=(1, 2)),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(packed_max_logits(q, k, torch.tensor([0, 0]), 0.3)[:0], torch.empty(0))


def test_vision_recording_off_by_default_output_unchanged_and_accumulates():
    attn = _vit()
    x, cu, rope = _vit_inputs()
    out = attn(x, cu, rope)
    assert attn.max_logits is None
    attn.record_max_logits = True
    assert torch.equal(attn(x, cu, rope), out)
    torch.testing.assert_close(attn.max_logits, _vit_max(attn, x, cu, rope), rtol=1e-5, atol=1e-5)
    first = attn.max_logits.clone()
    x2, cu2, rope2 = _vit_inputs([(1, 4, 4)], seed=2)
    attn(x2, cu2, rope2)
    torch.testing.assert_close(attn.max_logits, torch.maximum(first, _vit_max(attn, x2, cu2, rope2)),
                               rtol=1e-5, atol=1e-5)


def test_qk_clip_is_exact_on_vision_heads_with_bias():
    attn = _vit()
    h, d = attn.num_heads, attn.head_dim
    with torch.no_grad():  # boost heads 0 and 2 (weight and bias) so they clip, heads 1 and 3 do not
        attn.qkv.weight.view(3, h, d, -1)[0, [0, 2]] *= 4
        attn.qkv.bias.view(3, h, d)[0, [0, 2]] *= 4
    x, cu, rope = _vit_inputs()
    same = _same_segment(cu)
    before = _vit_pair_scores(attn, x, rope)
    s = before.masked_fill(~same, float("-inf")).amax(dim=(1, 2))
    tau = float((s[[0, 2]].min() + s[[1, 3]].max()) / 2)
    assert s[[1, 3]].max() < tau < s[[0, 2]].min()
    weight_only = copy.deepcopy(attn)  # the rejected alternative: scale the weight rows but not the bias
    opt = MuonClip(attn, lr=0.0, qk_clip_tau=tau)
    assert list(opt.attention_modules) == [""]
    v_rows = attn.qkv.weight.view(3, h, d, -1)[2].clone()
    v_bias = attn.qkv.bias.view(3, h, d)[2].clone()
    proj = [p.detach().clone() for p in attn.proj.parameters()]
    attn(x, cu, rope)
    opt.step()  # no gradients: only QK-Clip acts
    torch.testing.assert_close(opt.last_max_logits[""], s, rtol=1e-6, atol=1e-6)
    after = _vit_pair_scores(attn, x, rope)
    s_after = after.masked_fill(~same, float("-inf")).amax(dim=(1, 2))
    torch.testing.assert_close(s_after[[0, 2]], torch.full((2,), tau), rtol=1e-5, atol=0)
    assert torch.equal(after[[1, 3]], before[[1, 3]])
    gamma = tau / s
    for i in (0, 2):  # every pair of the head, cross-segment ones included: q_h and k_h are scaled exactly
        torch.testing.assert_close(after[i], gamma[i] * before[i], rtol=1e-5, atol=1e-5)
    assert torch.equal(attn.qkv.weight.view(3, h, d, -1)[2], v_rows)
    assert torch.equal(attn.qkv.bias.view(3, h, d)[2], v_bias)
    assert all(torch.equal(a, b) for a, b in zip(attn.proj.parameters(), proj))
    assert attn.max_logits is None
    with torch.no_grad():
        root = (tau / s).sqrt().clamp(max=1)
        weight_only.qkv.weight.view(3, h, d, -1)[:2] *= root[:, None, None]
    missed = _vit_pair_scores(weight_only, x, rope).masked_fill(~same, float("-inf")).amax(dim=(1, 2))
    assert ((missed[[0, 2]] - tau).abs() > 1e-3 * tau).all()


def test_cross_segment_logit_does_not_trigger_vision_clipping():
    attn = _vit()
    x, cu, rope = _vit_inputs([(1, 2, 2), (1, 2, 2)])
    with torch.no_grad():  # inputs 0..7 do not reach the queries; segment 1 lives there with huge keys
        attn.qkv.weight[: VIT.hidden_size, :8] = 0
        attn.qkv.bias[: VIT.hidden_size] = 0
        x[4:] = 0
        x[4:, :8] = 30 * torch.randn(4, 8)
    full = _vit_pair_scores(attn, x, rope)
    allowed_max = full.masked_fill(~_same_segment(cu), float("-inf")).amax(dim=(1, 2))
    tau = float(allowed_max.max()) + 1.0
    assert full[:, :4, 4:].amax() > 10 * tau  # segment 0's queries against segment 1's keys
    opt = MuonClip(attn, lr=0.0, qk_clip_tau=tau)
    weights = {n: p.detach().clone() for n, p in attn.named_parameters()}
    attn(x, cu, rope)
    opt.step()
    torch.testing.assert_close(opt.last_max_logits[""], allowed_max, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p, weights[n]) for n, p in attn.named_parameters())


def test_vision_qk_clip_is_configurable_and_vision_routing():
    model = tiny_vl()
    on = MuonClip(model, lr=1e-3)
    vision = [n for n in on.attention_modules if n.startswith("vision_tower.")]
    text = [n for n in on.attention_modules if not n.startswith("vision_tower.")]
    assert vision == ["vision_tower.layers.0.attn", "vision_tower.layers.1.attn"]
    assert text == ["language_model.model.layers.3.self_attn"]
    routes = on.routing()
    assert routes["vision_tower.layers.0.attn.qkv.weight"] == "muon"
    for name in ["vision_tower.layers.0.attn.qkv.bias", "vision_tower.patch_embed.pos_emb",
                 "vision_tower.patch_embed.proj.weight", "vision_tower.layers.0.norm1.weight"]:
        assert routes[name] == "adamw", name
    (pa, ga), (pb, gb) = image(4, 4), image(2, 6)
    ids = torch.tensor([sample([3, 4], [ga, gb], [6, 7, 8])])
    model.train()(ids, pixel_values=torch.cat([pa, pb]), image_grid_thw=torch.tensor([ga, gb]), labels=ids).loss.backward()
    on.step()
    assert sorted(on.last_max_logits) == sorted(vision + text)
    assert on.last_max_logits["vision_tower.layers.0.attn"].shape == (2,)
    off = MuonClip(model, lr=1e-3, qk_clip_vision=False)
    assert list(off.attention_modules) == text
    assert not any(m.record_max_logits for m in model.vision_tower.modules() if isinstance(m, MoonViTAttention))
    assert model.language_model.model.layers[3].self_attn.record_max_logits
    MuonClip(model, lr=1e-3, qk_clip_tau=None)
    assert not any(getattr(m, "record_max_logits", False) for m in model.modules())
    assert (ids == IMG).any()


def test_a_frozen_attention_is_not_clipped_until_added_and_a_partly_frozen_one_is_refused():
    """An optimizer changes only the parameters it holds: QK-Clip leaves a frozen vision tower's `qkv` alone (its
    max logits are still reported) and clips the trained text attention; once the tower is unfrozen and added with
    `add_param_group` (torch's progressive-unfreezing use), it is clipped too."""
    model = tiny_vl()
    model.vision_tower.requires_grad_(False)
    opt = MuonClip(model, lr=0.0, qk_clip_tau=1e-3)  # every recorded head clips; only QK-Clip changes weights
    tower = {n: p.detach().clone() for n, p in model.vision_tower.named_parameters()}
    mla = model.language_model.model.layers[3].self_attn
    kv_b = mla.kv_b_proj.weight.detach().clone()
    (pa, ga) = image(4, 4)
    ids = torch.tensor([sample([3, 4], [ga], [6, 7, 8])])

    def step():
        model.train()(ids, pixel_values=pa, image_grid_thw=torch.tensor([ga]), labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    assert all(torch.equal(p, tower[n]) for n, p in model.vision_tower.named_parameters())
    assert sorted(opt.last_max_logits) == sorted(opt.attention_modules) and len(opt.attention_modules) == 3
    assert not torch.equal(mla.kv_b_proj.weight, kv_b)  # the text attention's k_nope rows clipped
    model.vision_tower.requires_grad_(True)
    routes = route_parameters(model.vision_tower)
    for kind in ("muon", "adamw"):
        opt.add_param_group({"params": [p for n, p in model.vision_tower.named_parameters() if routes[n] == kind],
                             "kind": kind})
    step()
    qkv = model.vision_tower.layers[0].attn.qkv.weight
    assert not torch.equal(qkv, tower["layers.0.attn.qkv.weight"])
    mla.kv_b_proj.requires_grad_(False)  # q trained, k frozen: clipping q alone would not scale the logits by gamma
    with pytest.raises(ConfigError, match="language_model.model.layers.3.self_attn"):
        MuonClip(model, lr=1e-3)
    assert MuonClip(model, lr=1e-3, qk_clip_tau=None).attention_modules == {}


# ---------------------------------------------------------------- any QK-Clip target


class ToyAttention(nn.Module):
    """An attention kind MuonClip has never heard of, a `QKClipTarget` without any kimi_vl base class: separate
    q and k projections, and its own clip rule (all of gamma on the head's query rows, keys untouched)."""

    qk_clip_group = "text"

    def __init__(self, dim: int = 12, heads: int = 3) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.record_max_logits = False
        self.max_logits = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """`x [T, dim]` -> every pair's logit `[heads, T, T]`."""
        q, k = (proj(x).view(x.shape[0], self.num_heads, -1).transpose(0, 1) for proj in (self.q, self.k))
        return q @ k.mT * self.head_dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.logits(x)
        if self.record_max_logits:
            m = scores.detach().amax(dim=(1, 2))
            self.max_logits = m if self.max_logits is None else torch.maximum(self.max_logits, m)
        return scores.softmax(-1)

    def qk_clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.q.weight, gamma.repeat_interleave(self.head_dim))]


def test_a_new_attention_kind_is_clipped_through_the_interface():
    torch.manual_seed(0)
    toy = ToyAttention()
    assert isinstance(toy, QKClipTarget) and not isinstance(nn.Linear(2, 2), QKClipTarget)
    with torch.no_grad():  # boost head 1 so it clips; heads 0 and 2 do not
        toy.q.weight.view(3, 4, -1)[1] *= 5
    x = torch.randn(7, 12)
    before = toy.logits(x).detach()
    s = before.amax(dim=(1, 2))
    tau = float((s[1] + s[[0, 2]].max()) / 2)
    assert s[[0, 2]].max() < tau < s[1]
    model = nn.ModuleDict({"toy": toy, "mlp": nn.Linear(12, 12)})
    opt = MuonClip(model, lr=0.0, qk_clip_tau=tau, qk_clip_vision=False)
    assert list(opt.attention_modules) == ["toy"] and toy.record_max_logits
    k_before = toy.k.weight.detach().clone()
    toy(x)
    opt.step()
    torch.testing.assert_close(opt.last_max_logits["toy"], s)
    after = toy.logits(x).detach()
    torch.testing.assert_close(after[1], tau / s[1] * before[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[1].amax(), torch.tensor(tau), rtol=1e-5, atol=0)
    assert torch.equal(after[[0, 2]], before[[0, 2]])
    assert torch.equal(toy.k.weight, k_before)  # the toy's own rule was applied, not MLA's or MHA's
    assert toy.max_logits is None


def test_optimizer_imports_no_model_code_and_models_no_training_code():
    """The dependency direction: MuonClip reads only `kimi_vl.optim_contract`; kernels, text and vision modules and
    the contract never import `kimi_vl.training`."""
    root = Path(muonclip_mod.__file__).parents[1]

    def imports(path: Path) -> set[str]:
        package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                names.add(".".join(part for part in (base, node.module) if part))
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return {n for n in names if n.startswith("kimi_vl")}

    optimizer = imports(root / "training" / "muonclip.py")
    assert "kimi_vl.optim_contract" in optimizer
    assert not any(n.startswith(("kimi_vl.text", "kimi_vl.vision", "kimi_vl.modeling", "kimi_vl.fusion",
                                        "kimi_vl.tokenization"))
                   for n in optimizer), optimizer
    model_files = [root / "optim_contract.py", *(root / "kernels").rglob("*.py"), *(root / "text").rglob("*.py"),
                   *(root / "vision").rglob("*.py")]
    for path in model_files:
        assert not any(n.startswith("kimi_vl.training") for n in imports(path)), path


# ---------------------------------------------------------------- micro-batches and ranks


def _two_kinds():
    model = nn.ModuleDict({"mla": _mla(), "vit": _vit()})
    return model, torch.randn(2, 9, 32), _vit_inputs()


def test_max_logits_are_the_max_over_micro_batches_of_a_step():
    model, x, (v, cu, rope) = _two_kinds()
    x2, (v2, cu2, rope2) = torch.randn(2, 9, 32) * 3, _vit_inputs([(1, 4, 2)], seed=5)
    singles = []
    for xs, vs in [((x,), (v, cu, rope)), ((x2,), (v2, cu2, rope2))]:
        opt = MuonClip(model, lr=0.0, qk_clip_tau=1e9)
        model["mla"](*xs)
        model["vit"](*vs)
        opt.step()
        singles.append(opt.last_max_logits)
    opt = MuonClip(model, lr=0.0, qk_clip_tau=1e9)
    model["mla"](x)
    model["vit"](v, cu, rope)
    model["mla"](x2)
    model["vit"](v2, cu2, rope2)
    opt.step()
    for name in ("mla", "vit"):
        torch.testing.assert_close(opt.last_max_logits[name], torch.maximum(singles[0][name], singles[1][name]))
        assert model[name].max_logits is None
    opt.step()  # nothing recorded since: nothing reported
    assert opt.last_max_logits == {}
    model["vit"](v, cu, rope)
    opt.reset_max_logits()
    opt.step()
    assert opt.last_max_logits == {}


def test_a_discarded_step_leaves_no_trace_in_qk_clip():
    model, x, (v, cu, rope) = _two_kinds()
    opt = MuonClip(model, lr=0.0, qk_clip_tau=1e9)
    model["mla"](x)
    opt.step()
    assert list(opt.last_max_logits) == ["mla"]
    opt.qk_clip_tau = 1e-3  # every head that recorded anything would clip
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model["mla"](x)
    model["vit"](v, cu, rope)
    opt.discard_step()
    assert opt.last_max_logits == {}  # the skipped step reports nothing, not the previous step's maxima
    assert model["mla"].max_logits is None and model["vit"].max_logits is None
    opt.step()
    assert opt.last_max_logits == {}
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_max_logits_are_all_reduced_once_with_max_before_clipping(monkeypatch):
    """One flat collective for all modules; a larger max on another rank clips here too, and a module that ran
    only on the other rank is reported and clipped."""
    model, x, (v, cu, rope) = _two_kinds()
    calls = []
    remote = {}

    def fake_all_reduce_max(t):
        calls.append(t.clone())
        return t.copy_(torch.maximum(t, remote["flat"]))

    monkeypatch.setattr(muonclip_mod, "all_reduce_max", fake_all_reduce_max)
    model["vit"].record_max_logits = True
    model["vit"](v, cu, rope)
    local_vit = model["vit"].max_logits.clone()
    model["vit"].max_logits = None
    tau = float(local_vit.max()) + 1.0
    opt = MuonClip(model, lr=0.0, qk_clip_tau=tau)
    remote_mla = torch.full((4,), tau / 2)  # the MLA ran only on the other rank, below tau
    remote_vit = torch.full((4,), float("-inf"))
    remote_vit[1] = 2 * tau  # head 1 exceeds tau on the other rank only
    remote["flat"] = torch.cat([remote_mla, remote_vit])
    model["vit"](v, cu, rope)
    opt.step()
    assert len(calls) == 1 and calls[0].shape == (8,)
    assert torch.equal(calls[0][:4], torch.full((4,), float("-inf")))  # the MLA did not run here
    torch.testing.assert_close(opt.last_max_logits["mla"], remote_mla)
    torch.testing.assert_close(opt.last_max_logits["vit"], torch.maximum(local_vit, remote_vit))
    after = _vit_max(model["vit"], v, cu, rope)
    torch.testing.assert_close(after[1], local_vit[1] * 0.5, rtol=1e-5, atol=1e-6)  # gamma = tau / (2 tau)
    assert torch.equal(after[[0, 2, 3]], _vit_max(model["vit"], v, cu, rope)[[0, 2, 3]])
    torch.testing.assert_close(after[[0, 2, 3]], local_vit[[0, 2, 3]], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- integration: logit explosion


def _retrieval_batch(n, gen, keys=8, values=8, pairs=8):
    """Key-value retrieval: `pairs` tokens `key * values + value` (distinct keys), a query token naming one key,
    then the answer (its value); only the answer is a label. Solving it sharply rewards ever larger logits."""
    k = torch.argsort(torch.rand(n, keys, generator=gen), 1)[:, :pairs]
    v = torch.randint(0, values, (n, pairs), generator=gen)
    pick = torch.randint(0, pairs, (n,), generator=gen)
    rows = torch.arange(n)
    answer = keys * values + keys + v[rows, pick]
    ids = torch.cat([k * values + v, (keys * values + k[rows, pick])[:, None], answer[:, None]], 1)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = answer
    return ids, labels


def _retrieval_model():
    torch.manual_seed(0)
    cfg = KimiTextConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=1, layer_types=["mla"],
                         num_attention_heads=2, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                         first_k_dense=1, residual="standard", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, kda_num_heads=2, kda_head_dim=8, pad_token_id=None,
                         bos_token_id=None, eos_token_id=None)
    return KimiTextForCausalLM(cfg).train()


def _forward_backward(model, opt, batch):
    ids, labels = batch
    loss = model(ids, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item()


def test_qk_clip_keeps_an_exploding_max_logit_near_tau():
    """No weight decay, Muon at a high lr on key-value retrieval (batch 512, so batch-to-batch noise in the max is
    small). At the first step whose forward passes tau = 10 the run forks: a copy without QK-Clip keeps growing
    (> 2 tau within 45 steps), while with QK-Clip every later step's recorded max (before clipping) stays <= 1.05
    tau, and both solve the task."""
    tau, after = 10.0, 45
    gen = torch.Generator().manual_seed(0)
    batches = [_retrieval_batch(512, gen) for _ in range(200)]
    model = _retrieval_model()
    opt = MuonClip(model, lr=0.01, weight_decay=0.0, qk_clip_tau=tau)
    name = "model.layers.0.self_attn"
    free, first = None, None
    clipped_max, free_max, clipped_losses, free_losses = [], [], [], []
    for i, batch in enumerate(batches):
        clipped_losses.append(_forward_backward(model, opt, batch))
        if free is None and float(opt.attention_modules[name].max_logits.max()) > tau:
            free, first = copy.deepcopy((model, opt)), i  # gradients and recorded maxima come along
            free[1].qk_clip_tau = float("inf")
            free_losses.append(clipped_losses[-1])
        elif free is not None:
            free_losses.append(_forward_backward(*free, batch))
        opt.step()
        clipped_max.append(float(opt.last_max_logits[name].max()))
        if free is not None:
            free[1].step()
            free_max.append(float(free[1].last_max_logits[name].max()))
            if i == first + after:
                break
    assert first is not None and first > 20 and len(free_max) == after + 1
    assert free_max[0] == clipped_max[first] > tau
    assert max(free_max) > 2 * tau
    assert max(clipped_max) <= 1.05 * tau
    assert max(clipped_max[first + 5 :]) > 0.95 * tau  # clipped every step, not pushed far below tau
    assert sum(clipped_losses[-10:]) / 10 < 0.05 and sum(free_losses[-10:]) / 10 < 0.05
