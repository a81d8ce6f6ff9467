"""Attention Residuals: zero-query equivalence, initial weights and gradients, two-phase == direct, causality."""

import pytest
import torch

from kimi_vl.optim_contract import ADAMW, parameter_routes
from kimi_vl.text import KimiTextForCausalLM
from kimi_vl.text.attnres import AttnResidual

from .test_model import tiny_model

DEPTH = 8  # 4 layers -> 8 sublayers


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _with_residual(residual: str, block: int = 6, seed: int = 0) -> KimiTextForCausalLM:
    """The same sublayer weights under another residual stream."""
    return tiny_model(seed=seed, residual=residual, attnres_block_size=block)


def _randomise_queries(model: KimiTextForCausalLM, std: float = 1.0) -> None:
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "residual.queries" in name or "final_query" in name:
                p.normal_(0, std)
            elif "residual.key_norms" in name or "final_key_norm" in name:
                p.uniform_(0.5, 1.5)


@pytest.mark.parametrize("residual, block", [("attnres", 1), ("block_attnres", 2), ("block_attnres", 4),
                                             ("block_attnres", 3), ("block_attnres", DEPTH)])
def test_zero_queries_equal_standard_residual(residual, block):
    ids = torch.randint(3, 61, (2, 37))
    ref = _logits(_with_residual("standard"), ids)
    got = _logits(_with_residual(residual, block), ids)
    assert (got - ref).abs().max() < 1e-5
    assert ref.std() > 0.1


def test_initial_weights_uniform_and_every_query_gets_gradient():
    model = _with_residual("block_attnres", 4).train()
    res = model.model.residual
    assert all((q == 0).all() for q in res.queries) and (res.final_query == 0).all()
    state = res.begin(torch.randn(2, 5, 32))
    for l in range(DEPTH + 1):
        h = res.read(state, l) if l < DEPTH else None
        if l:  # sublayer 0 reads the embedding alone
            w = res.depth_weights(state, l)
            assert w.shape[0] == len(state.sources) + (state.partial is not None) > 1
            assert torch.allclose(w, torch.full_like(w, 1 / w.shape[0]))
        if h is not None:
            res.write(state, l, torch.randn_like(h))
    ids = torch.randint(3, 61, (2, 21))
    model(ids, labels=ids).loss.backward()
    for q in [*res.queries, res.final_query]:
        assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.mark.parametrize("block", [1, 2, 3, 4, DEPTH])
def test_two_phase_equals_direct_with_random_queries(block):
    model = _with_residual("block_attnres", block)
    _randomise_queries(model)
    ids = torch.randint(3, 61, (2, 19))
    fast = _logits(model, ids)
    model.model.residual.two_phase = False
    direct = _logits(model, ids)
    # End to end, fp32 rounding differences (summation order) grow through 8 random sublayers and the MoE;
    # the 1e-6 check of the computation itself is sublayer by sublayer below.
    assert (fast - direct).abs().max() < 1e-3
    assert (fast - _logits(_with_residual("standard"), ids)).abs().max() > 1e-2  # the queries matter

    res = AttnResidual(16, 7, block)  # sublayer by sublayer, including each block's first sublayer
    _randomise_queries(torch.nn.ModuleDict({"residual": res}))
    emb = torch.randn(3, 4, 16)
    outs = [torch.randn(3, 4, 16) for _ in range(7)]
    hs = {}
    for two_phase in (True, False):
        res.two_phase = two_phase
        state = res.begin(emb)
        hs[two_phase] = []
        for l, out in enumerate(outs):
            hs[two_phase].append(res.read(state, l))
            res.write(state, l, out)
        hs[two_phase].append(res.end(state))
    for a, b in zip(hs[True], hs[False]):
        assert (a - b).abs().max() < 1e-6 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("block", [1, 3, DEPTH])
def test_activation_checkpointing_recomputes_the_depth_mixing_with_the_same_gradients(block):
    """Under activation checkpointing each block's phase 1 and each sublayer's phase 2 run through the checkpoint
    function (recomputed in the backward pass, from the sources as they were: later blocks append to the lists),
    and every gradient, the queries' included, is the one without it, bit for bit."""
    model = _with_residual("block_attnres", block).train()
    _randomise_queries(model)
    ids = torch.randint(3, 61, (2, 19))
    model(ids, labels=ids, use_cache=False).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing_enable()
    res = model.model.residual
    enabled, calls = res._gradient_checkpointing_func, []
    res._gradient_checkpointing_func = lambda fn, *a: calls.append(fn.__name__) or enabled(fn, *a)
    model(ids, labels=ids, use_cache=False).loss.backward()
    blocks = len(range(0, DEPTH, block))
    assert calls.count("_phase1") == blocks - (block == 1) and calls.count("_phase2") == DEPTH - 1
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(ref)
    for n, p in model.named_parameters():
        if n in ref:
            assert torch.equal(p.grad, ref[n]), n


def test_depth_mixing_of_token_t_ignores_token_t_plus_1():
    res = AttnResidual(16, 6, 2)
    _randomise_queries(torch.nn.ModuleDict({"residual": res}))
    emb = torch.randn(1, 6, 16)
    outs = [torch.randn(1, 6, 16) for _ in range(6)]

    def weights(perturb: bool):
        state = res.begin(emb.clone())
        ws = []
        for l, out in enumerate(outs):
            out = out.clone()
            if perturb:
                out[:, 4] += 10 * torch.randn(16)  # token t+1 = 4
            res.read(state, l)
            if l:
                ws.append(res.depth_weights(state, l))
            res.write(state, l, out)
        return ws

    for a, b in zip(weights(False), weights(True)):
        assert torch.equal(a[:, :, :4], b[:, :, :4])
    # And end to end: logits of earlier tokens do not see a later token.
    model = _with_residual("block_attnres", 2)
    _randomise_queries(model)
    ids = torch.randint(3, 61, (1, 12))
    other = ids.clone()
    other[0, 7] = (ids[0, 7] + 1) % 61
    assert torch.allclose(_logits(model, ids)[0, :7], _logits(model, other)[0, :7], atol=1e-6)


@torch.no_grad()
def test_attnres_with_cache_and_packing():
    model = _with_residual("block_attnres", 3)
    _randomise_queries(model)
    ids = torch.randint(3, 61, (1, 40))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :30], use_cache=True)
    cache = out.cache
    for t in range(30, 40):
        step = model(ids[:, t : t + 1], cache=cache).logits
        assert (step[:, 0] - full[:, t]).abs().max() < 1e-4
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    packed = model(ids, cu_seqlens=cu).logits
    assert (packed[0, 15:] - model(ids[:, 15:]).logits[0]).abs().max() < 1e-4


def test_attnres_parameters_are_declared_adamw():
    model = _with_residual("block_attnres", 4)
    residual = model.model.residual
    assert {n.split(".")[0] for n, _ in residual.named_parameters()} == set(AttnResidual.optimizer_routes)
    assert set(AttnResidual.optimizer_routes.values()) == {ADAMW}
    routes = parameter_routes(model)
    declared = {n for n in routes if ".residual." in n}
    assert len(declared) == 2 * (DEPTH - 1) + 2 and all(routes[n] == ADAMW for n in declared)
    assert all(p.ndim == 1 for n, p in model.named_parameters() if n in declared)


@pytest.mark.parametrize("two_phase", [True, False])
def test_depth_mixing_stays_fp32_under_bf16_autocast(two_phase):
    """The depth softmax and the weighted sum of the sources are fp32 also under mixed precision (autocast would
    run their matmuls in bf16)."""
    res = AttnResidual(16, 7, 3)
    _randomise_queries(torch.nn.ModuleDict({"residual": res}))
    res.two_phase = two_phase
    emb = torch.randn(3, 4, 16)
    outs = [torch.randn(3, 4, 16) for _ in range(7)]
    hs = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            state = res.begin(emb)
            h = []
            for l, out in enumerate(outs):
                h.append(res.read(state, l))
                res.write(state, l, out)
            h.append(res.end(state))
        hs.append(h)
    for a, b in zip(*hs, strict=True):
        assert a.dtype == torch.float32
        assert (a - b).abs().max() < 1e-6 * max(1.0, b.abs().max().item())
