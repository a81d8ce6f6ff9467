"""Behaviour of the text backbone: cache equivalence, sampling/batched generation, cache memory, bad input."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kimi_vl.errors import ConfigError, ShapeError
from kimi_vl.text import KimiHybridCache, KimiTextConfig, KimiTextForCausalLM


def tiny_config(**kw) -> KimiTextConfig:
    base = dict(
        vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        num_experts=4, num_experts_per_tok=2, kda_head_dim=8, kda_num_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return KimiTextConfig(**base)


def tiny_model(seed: int = 0, **kw) -> KimiTextForCausalLM:
    torch.manual_seed(seed)
    model = KimiTextForCausalLM(tiny_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "conv" not in name:
                p.normal_(0, 0.2)
    return model


def test_default_layout_is_3_to_1_hybrid():
    assert tiny_config(num_hidden_layers=8).layer_types == ["kda", "kda", "kda", "mla"] * 2


def test_kimis_token_ids_are_the_defaults_only_where_the_vocabulary_holds_them(caplog):
    kimi = KimiTextConfig()
    assert (kimi.pad_token_id, kimi.bos_token_id, kimi.eos_token_id) == (163839, 163584, 163586)
    with caplog.at_level("WARNING"):
        own = KimiTextConfig(vocab_size=32000, eos_token_id=5)
    assert (own.pad_token_id, own.bos_token_id, own.eos_token_id) == (None, None, 5)
    assert "within the vocabulary" not in caplog.text  # transformers' warning about an out-of-range id


@torch.no_grad()
def test_cached_decode_equals_full_forward_every_step():
    model = tiny_model()
    ids = torch.randint(3, 61, (2, 90))
    full = model(ids, use_cache=False).logits
    cache = KimiHybridCache(model.config)
    step = model(ids[:, :70], cache=cache, use_cache=True).logits
    assert (step - full[:, :70]).abs().max() < 1e-4
    for t in range(70, 90):  # one token at a time: recurrent KDA + absorbed MLA
        step = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits
        assert (step[:, 0] - full[:, t]).abs().max() < 1e-4
    assert cache.get_seq_length() == 90


@torch.no_grad()
def test_multi_token_continuation_with_cache():
    model = tiny_model()
    ids = torch.randint(3, 61, (1, 120))
    full = model(ids, use_cache=False).logits
    cache = KimiHybridCache(model.config)
    model(ids[:, :50], cache=cache)
    got = model(ids[:, 50:], cache=cache).logits  # 70 new tokens: chunked KDA, expanded MLA
    assert (got - full[:, 50:]).abs().max() < 1e-4


@torch.no_grad()
def test_left_padded_batch_matches_unpadded_rows():
    model = tiny_model()
    a, b = torch.randint(3, 61, (1, 30)), torch.randint(3, 61, (1, 18))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 12, dtype=torch.long), b], 1)])
    mask = (torch.arange(30) >= torch.tensor([[0], [12]])).long()
    batched = model(ids, attention_mask=mask).logits
    assert (batched[0] - model(a).logits[0]).abs().max() < 1e-4
    assert (batched[1, 12:] - model(b).logits[0]).abs().max() < 1e-4

    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    alone = model.generate(b, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out[1, 12:], alone[0])


@torch.no_grad()
def test_padding_before_cached_tokens_or_kept_in_the_cache_matches_unpadded_rows():
    """Pads a cache outlives (right padding of a prefill, then a decode step) or that come after cached tokens (a
    left-padded second turn continuing each row's cache) never decay the KDA state or enter the conv tail: every
    row's logits equal its unpadded run's."""
    model = tiny_model()
    a, b = torch.randint(3, 61, (1, 9)), torch.randint(3, 61, (1, 5))
    ids = torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], 1)])
    mask = (torch.arange(9) < torch.tensor([[9], [5]])).long()
    cache = KimiHybridCache(model.config)
    assert (model(ids, attention_mask=mask, cache=cache).logits[1, :5] - model(b).logits[0]).abs().max() < 1e-4
    step = model(torch.tensor([[7], [8]]), attention_mask=F.pad(mask, (0, 1), value=1), cache=cache).logits
    assert (step[1, 0] - model(torch.cat([b, torch.tensor([[8]])], 1)).logits[0, -1]).abs().max() < 1e-4

    first, second_a, second_b = torch.randint(3, 61, (2, 6)), torch.randint(3, 61, (1, 4)), torch.randint(3, 61, (1, 2))
    cache = KimiHybridCache(model.config)
    model(first, cache=cache)
    second = torch.cat([second_a, F.pad(second_b, (2, 0))])
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:8] = 0
    got = model(second, attention_mask=mask, cache=cache).logits
    assert (got[0] - model(torch.cat([first[:1], second_a], 1)).logits[0, 6:]).abs().max() < 1e-4
    assert (got[1, 2:] - model(torch.cat([first[1:], second_b], 1)).logits[0, 6:]).abs().max() < 1e-4


@torch.no_grad()
def test_sampled_generation_is_seeded_and_uses_the_cache():
    model = tiny_model()
    ids = torch.randint(3, 61, (2, 10))
    kw = dict(max_new_tokens=8, do_sample=True, top_k=5, temperature=0.8, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(3)
    a = model.generate(ids, **kw)
    torch.manual_seed(3)
    b = model.generate(ids, **kw)
    assert torch.equal(a, b) and a.shape == (2, 18)
    torch.manual_seed(3)
    c = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(a, c)


@torch.no_grad()
def test_past_key_values_is_taken_as_the_cache():
    """transformers' older name (what `outputs.past_key_values` reads) must not be swallowed by **kwargs."""
    model = tiny_model()
    ids = torch.randint(3, 61, (1, 20))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :12])
    got = model(ids[:, 12:], past_key_values=out.past_key_values).logits
    assert (got - full[:, 12:]).abs().max() < 1e-4
    assert out.past_key_values.get_seq_length() == 20


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # transformers' own, on generate
def test_a_transformers_dynamic_cache_is_refused_with_what_to_pass():
    """`past_key_values=DynamicCache()` (transformers' usual way to hand `generate` a cache) cannot hold KDA states:
    refused up front, naming the cache to pass, instead of an AttributeError inside the first KDA layer."""
    model = tiny_model()
    ids = torch.randint(3, 61, (1, 6))
    with pytest.raises(ConfigError, match="DynamicCache cannot hold .* pass a KimiHybridCache"):
        model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ConfigError, match="DynamicCache cannot hold"):
        model(ids, cache=DynamicCache())


@pytest.mark.parametrize("layer_types", [None, ["kda"] * 4, ["mla_rope"] * 4])
@torch.no_grad()
def test_generate_continues_from_a_returned_cache(layer_types):
    """`generate(all ids so far, cache=the cache a previous call returned)` runs only the ids the cache has not
    seen (a multi-turn chat reusing its cache), as one call would."""
    model = tiny_model(layer_types=layer_types) if layer_types else tiny_model()
    ids = torch.randint(3, 61, (2, 15))
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    first = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True, **kw)
    assert first.cache.get_seq_length() == 18  # the last new token is not fed yet
    more = model.generate(first.sequences, cache=first.cache, max_new_tokens=6, **kw)
    assert torch.equal(more, model.generate(ids, max_new_tokens=10, **kw))


@torch.no_grad()
def test_a_returned_cache_continues_with_several_replies_per_row():
    """A next turn continuing a batch's cache with `num_return_sequences` / `num_beams` > 1 gives the replies of the
    same call without a cache (every copy of a row continues that row's state)."""
    model = tiny_model()
    ids = torch.randint(3, 61, (2, 9))
    kw = dict(pad_token_id=0, eos_token_id=None)
    first = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **kw)
    turn = torch.cat([first.sequences, torch.randint(3, 61, (2, 2))], 1)
    for gen in (dict(do_sample=True, num_return_sequences=3), dict(do_sample=False, num_beams=2, num_return_sequences=2)):
        cache = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **kw).cache
        torch.manual_seed(1)
        got = model.generate(turn, cache=cache, max_new_tokens=4, **gen, **kw)
        torch.manual_seed(1)
        assert torch.equal(got, model.generate(turn, max_new_tokens=4, **gen, **kw))


@torch.no_grad()
def test_cache_implementation_is_ignored_with_a_warning():
    """A `cache_implementation` naming another kind of cache (static, offloaded, ...) cannot be honoured: generate
    says so and decodes with its KimiHybridCache, token for token as without it."""
    model = tiny_model()
    ids = torch.randint(3, 61, (1, 6))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = model.generate(ids, **kw)
    with pytest.warns(UserWarning, match="cache_implementation='static' is ignored"):
        assert torch.equal(model.generate(ids, cache_implementation="static", **kw), plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model.generate(ids, cache_implementation="dynamic", **kw), plain)


@pytest.mark.parametrize("draft", ["assistant_model", "prompt_lookup_num_tokens"])
@torch.no_grad()
def test_assisted_generation_is_refused_before_decoding(draft):
    """Assisted decoding rewinds the cache past rejected draft tokens, which a KDA recurrent state cannot do: it is
    refused up front (transformers' check of `_is_stateful`), not after a prefill or with wrong tokens."""
    model = tiny_model()
    kw = {"assistant_model": tiny_model(seed=1)} if draft == "assistant_model" else {draft: 2}
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(torch.randint(3, 61, (1, 6)), max_new_tokens=4, do_sample=False, pad_token_id=0, **kw)


@torch.no_grad()
def test_beam_search_finds_the_exhaustive_best_continuation():
    """Beam search over 2 new tokens (no EOS, no length penalty) returns the most likely pair of all vocab**2."""
    model = tiny_model().double()
    ids = torch.randint(3, 61, (1, 5))
    pairs = torch.cartesian_prod(torch.arange(61), torch.arange(61))
    seqs = torch.cat([ids.expand(len(pairs), -1), pairs], 1)
    logp = model(seqs, use_cache=False).logits[:, 4:6].log_softmax(-1)
    scores = logp.gather(-1, pairs[:, :, None]).sum((1, 2))
    out = model.generate(ids, max_new_tokens=2, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                         length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    assert out.sequences[0, 5:].tolist() == pairs[scores.argmax()].tolist()
    assert abs(out.sequences_scores.item() - scores.max().item()) < 1e-5


@torch.no_grad()
def test_packed_sequences_equal_separate_runs():
    model = tiny_model()
    seqs = [torch.randint(3, 61, (1, n)) for n in (7, 40, 23)]
    cu = torch.tensor([0, 7, 47, 70], dtype=torch.int32)
    packed = model(torch.cat(seqs, 1), cu_seqlens=cu).logits
    for s, (lo, hi) in zip(seqs, zip(cu[:-1], cu[1:])):
        assert (packed[0, lo:hi] - model(s).logits[0]).abs().max() < 1e-4


def test_loss_ignores_minus_100_and_trains():
    model = tiny_model().train()
    ids = torch.randint(3, 61, (2, 33))
    labels = ids.clone()
    labels[:, :10] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 61)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], target[keep])
    assert torch.allclose(out.loss, ref)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items() if "e_score" not in n)
    assert grads["model.layers.0.self_attn.A_log"].abs().sum() > 0


def test_tied_embeddings_share_storage(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    again = KimiTextForCausalLM.from_pretrained(tmp_path)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, 61, (1, 9))
    assert torch.allclose(again(ids).logits, model(ids).logits, atol=1e-6)


def test_auto_classes_load_our_checkpoint(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    import kimi_vl  # noqa: F401  (registers the Auto classes)

    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "kimi_vl_text"
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), KimiTextForCausalLM)


def test_router_bias_update_balances_load():
    model = tiny_model().train()
    router = model.model.layers[1].mlp.gate
    model(torch.randint(3, 61, (2, 40)))
    load = router.expert_load.clone()
    assert load.sum() == 2 * 40 * 2  # tokens x top-k
    model.model.update_router_biases(rate=0.01)
    bias = router.e_score_correction_bias
    assert torch.equal(torch.sign(bias), torch.sign(load.mean() - load))
    assert router.expert_load.sum() == 0


def test_moe_matches_per_token_loop():
    model = tiny_model()
    moe = model.model.layers[2].mlp
    x = torch.randn(2, 11, 32)
    got = moe(x)
    flat = x.reshape(-1, 32)
    w, idx = moe.gate(flat)
    ref = torch.stack([
        sum(w[n, j] * torch.nn.functional.linear(
            torch.nn.functional.silu(flat[n] @ moe.experts.w1[idx[n, j]].T) * (flat[n] @ moe.experts.w3[idx[n, j]].T),
            moe.experts.w2[idx[n, j]]) for j in range(idx.shape[1]))
        for n in range(flat.shape[0])
    ]).view_as(x) + moe.shared_experts(x)
    assert torch.allclose(got, ref, atol=1e-5)


def test_absorbed_mla_equals_expanded():
    model = tiny_model(layer_types=["mla"] * 4)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 12, 32)
    cache = KimiHybridCache(model.config)
    full = attn(x)
    attn(x[:, :11], cache=cache)
    cache.advance(11)
    step = attn(x[:, 11:], cache=cache)  # absorbed path
    assert (step[:, 0] - full[:, 11]).abs().max() < 1e-5


def test_cache_bytes_per_token_hybrid_vs_all_mla():
    """At 4K tokens the 3:1 hybrid stores <= 0.3x the cache bytes of all-MLA with the same sizes."""
    kw = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=8, kda_num_heads=4, kda_head_dim=64,
              num_attention_heads=4, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=512)
    with torch.device("meta"):
        hybrid = KimiTextForCausalLM(KimiTextConfig(**kw)).model
        mla = KimiTextForCausalLM(KimiTextConfig(layer_types=["mla"] * 8, **kw)).model
    ratio = hybrid.cache_bytes_per_token(4096, torch.bfloat16) / mla.cache_bytes_per_token(4096, torch.bfloat16)
    assert ratio <= 0.3
    # The formula agrees with what a real cache holds.
    model = tiny_model()
    cache = KimiHybridCache(model.config)
    with torch.no_grad():
        model(torch.randint(3, 61, (1, 100)), cache=cache)
    assert cache.nbytes() == pytest.approx(model.model.cache_bytes_per_token(100) * 100)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(layer_types=["kda", "attention", "kda", "mla"]), "layer_types"),
        (dict(layer_types=["kda", "mla"]), "num_hidden_layers"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(num_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3), "topk_group=1 kept groups"),
        (dict(residual="highway"), "residual"),
    ],
)
def test_invalid_config_raises_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**kw)


def test_bad_forward_inputs_raise():
    model = tiny_model()
    ids = torch.randint(3, 61, (2, 10))
    with pytest.raises(ShapeError, match="cu_seqlens"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ShapeError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(ShapeError, match="exactly one"):
        model()
    with pytest.raises(ShapeError, match=r"no tokens \(shape \[2, 0\]\)"):  # was a raw ValueError from the experts
        model(ids[:, :0])


def test_attention_outputs_are_refused_not_answered_with_none():
    model = tiny_model()
    ids = torch.randint(3, 61, (1, 6))
    for call in (lambda: model(ids, output_attentions=True), lambda: model.model(ids, output_attentions=True),
                 lambda: model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)):
        with pytest.raises(ConfigError, match="output_attentions"):
            call()
    assert model(ids, output_attentions=False).logits.shape == (1, 6, 61)


def test_hidden_states_and_gradient_checkpointing():
    model = tiny_model().train()
    ids = torch.randint(3, 61, (2, 20))
    out = model(ids, labels=ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids))
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable()
    assert model.model.gradient_checkpointing
    enabled, calls = model.model._gradient_checkpointing_func, []  # the enable call's function runs each sublayer
    model.model._gradient_checkpointing_func = lambda fn, *a: calls.append(fn) or enabled(fn, *a)
    model(ids, labels=ids).loss.backward()
    assert calls == [m for layer in model.model.layers for m in (layer.attention, layer.feed_forward)]
    for n, p in model.named_parameters():
        if n in ref:
            assert torch.allclose(p.grad, ref[n], atol=1e-6), n


@pytest.mark.parametrize("residual", ["block_attnres", "attnres"])
def test_reentrant_activation_checkpointing_keeps_every_gradient(residual):
    """`use_reentrant=True` (PEFT's default) sees only tensor arguments: AttnRes's depth mixing takes lists of
    sources, whose gradient it cut (parameters without gradients, others wrong) until they were passed one by one."""
    model = tiny_model(residual=residual, attnres_block_size=2).train()
    ids = torch.randint(3, 61, (2, 12))
    model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys()
    for n, g in grads.items():
        assert torch.allclose(g, ref[n], atol=1e-6), n


def test_per_document_loss_weighs_every_packed_sequence_equally():
    """`per_document`: the mean over the packed sequences of each one's token mean (boundary targets excluded as in
    the token mean), so a 2-target document counts as much as a 5-target one; it needs packed inputs."""
    from kimi_vl.errors import ShapeError
    from kimi_vl.text.modeling import causal_lm_loss

    logits, labels = torch.randn(1, 10, 7), torch.randint(0, 7, (1, 10))
    labels[0, 2] = -100
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    ce = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")
    expected = (ce[[0, 2]].mean() + ce[4:9].mean()) / 2  # position 1's target is -100, position 3 crosses the boundary
    torch.testing.assert_close(causal_lm_loss(logits, labels, cu, per_document=True), expected)
    torch.testing.assert_close(causal_lm_loss(logits, labels, cu), ce[[0, 2, 4, 5, 6, 7, 8]].mean())
    with pytest.raises(ShapeError, match="packed inputs"):
        causal_lm_loss(logits, labels, per_document=True)


def test_empty_packed_sequences_at_the_start_mask_no_target():
    """A pack may begin with empty sequences (`cu_seqlens` `[0, 0, ...]`): they end before any token, so no target
    is masked for them (an offset of -1 must not wrap around to the pack's last target)."""
    from kimi_vl.text.modeling import causal_lm_loss, next_token_targets

    labels = torch.arange(6)[None]
    assert next_token_targets(labels, torch.tensor([0, 0, 0, 6])).tolist() == [[1, 2, 3, 4, 5]]
    assert next_token_targets(labels, torch.tensor([0, 0, 3, 6])).tolist() == [[1, 2, -100, 4, 5]]
    logits = torch.randn(1, 6, 7)
    torch.testing.assert_close(causal_lm_loss(logits, labels, torch.tensor([0, 0, 6], dtype=torch.int32)),
                               causal_lm_loss(logits, labels))


@pytest.mark.parametrize("per_document", [False, True])
def test_chunked_loss_equals_the_full_loss_and_never_keeps_the_logits(per_document):
    """`chunked_causal_lm_loss` (chunks of 4 tokens with a remainder of 3 here) gives `causal_lm_loss` of the full
    logits and the same gradients; it saves no activation over the vocabulary for the backward (the chunks' logits
    are recomputed there), where the full loss keeps `[tokens, vocab]` (its log-softmax)."""
    from kimi_vl.text.modeling import causal_lm_loss, chunked_causal_lm_loss

    torch.manual_seed(0)
    V, T = 11, 16
    head = torch.nn.Linear(8, V, bias=False)
    hidden = torch.randn(1, T, 8, requires_grad=True)
    labels = torch.randint(0, V, (1, T))
    labels[0, [2, 9]] = -100
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)

    weight = head.weight.untyped_storage().data_ptr()

    def logit_sized(t: torch.Tensor) -> int:  # a saved activation over the vocabulary (not the head's weight)
        return t.numel() if t.dim() and t.shape[-1] == V and t.untyped_storage().data_ptr() != weight else 0

    def run(loss_fn):
        saved = []
        hidden.grad = head.weight.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(logit_sized(t)) or t, lambda t: t):
            loss = loss_fn()
        loss.backward()
        return loss.detach(), hidden.grad.clone(), head.weight.grad.clone(), sum(saved)

    full = run(lambda: causal_lm_loss(head(hidden), labels, cu, per_document=per_document))
    chunked = run(lambda: chunked_causal_lm_loss(hidden, head, labels, cu, per_document=per_document,
                                                 max_elements=4 * V))
    for a, b in zip(chunked[:3], full[:3]):
        torch.testing.assert_close(a, b)
    assert full[3] >= (T - 1) * V and chunked[3] == 0


def test_training_forward_without_logits_gives_the_same_loss(monkeypatch):
    """`return_logits=False` (the trainer's forwards): above `LOSS_CHUNK_ELEMENTS` logits the loss is computed in
    chunks and no logits come back; loss and gradients are those of the ordinary forward, packed and per document
    too. Below it (every CPU preset's batch) the ordinary path runs."""
    import kimi_vl.text.modeling as modeling

    model = tiny_model()
    ids = torch.randint(3, model.config.vocab_size, (1, 24))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(ids, labels=ids, cu_seqlens=cu, loss_normalisation="document", return_logits=return_logits)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert results[1][0].logits is not None  # 24 tokens: under the threshold, nothing changes
    monkeypatch.setattr(modeling, "LOSS_CHUNK_ELEMENTS", 5 * model.config.vocab_size)
    model.zero_grad()
    out = model(ids, labels=ids, cu_seqlens=cu, loss_normalisation="document", return_logits=False)
    out.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss, results[0][0].loss)
    for n, p in model.named_parameters():
        if n in results[0][1]:
            torch.testing.assert_close(p.grad, results[0][1][n], atol=1e-6, rtol=1e-5, msg=n)


def test_routers_count_only_real_tokens():
    """Left padding (attention_mask 0) and a tail of pad ids (mask 1, as after a response's end token) are routed but
    not counted: the padded batch adds to each expert's load what its rows add alone."""
    model = tiny_model().train()
    routers = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
    rows = [torch.randint(3, 61, (7,)), torch.randint(3, 61, (12,))]
    for row in rows:
        model(row[None])
    alone = [r.expert_load.clone() for r in routers]
    model.model.reset_expert_loads()
    ids = torch.zeros(2, 15, dtype=torch.long)
    mask = torch.ones(2, 15, dtype=torch.long)
    ids[0, 5:12], mask[0, :5] = rows[0], 0  # 5 left-padded positions, then 3 pad ids after the row
    ids[1, :12] = rows[1]  # 3 pad ids after the row
    model(ids, attention_mask=mask)
    for router, load in zip(routers, alone):
        assert router.expert_load.sum() == (7 + 12) * 2  # real tokens x top-k
        assert torch.equal(router.expert_load, load)


@pytest.mark.parametrize("load", ["to", "from_pretrained"])
def test_router_balancing_stays_fp32_in_a_bf16_model(tmp_path, load):
    """bf16 would absorb a 1e-3 bias step near 0.5 and stop counting single tokens past 256; `from_pretrained` must
    not leave the (unsaved) load counter uninitialised."""
    model = tiny_model()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.fill_(0.5)
    if load == "to":
        model = model.to(torch.bfloat16)
    else:
        model.save_pretrained(tmp_path)
        model = KimiTextForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == gate.expert_load.dtype == torch.float32
    assert gate.expert_load.sum() == 0
    model.train()
    with torch.no_grad():
        model(torch.randint(3, 61, (2, 300)))
    assert gate.expert_load.sum() == 2 * 300 * model.config.num_experts_per_tok
    model.model.update_router_biases(1e-3)
    assert ((gate.e_score_correction_bias - 0.5).abs() - 1e-3).abs().max() < 1e-6


def test_router_scores_stay_fp32_under_bf16_autocast():
    """`s = sigmoid(x W^T)` in fp32 also under mixed precision: bf16 router logits change which experts are chosen.
    On CUDA's autocast too where a GPU is present (`bench/gpu_checks.sh` runs it there)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate = tiny_model().model.layers[1].mlp.gate.to(device)
    x = torch.randn(64, gate.weight.shape[1]).to(device) * 3
    weights, indices = gate(x)
    with torch.autocast(device, dtype=torch.bfloat16):
        weights_ac, indices_ac = gate(x)
    assert weights_ac.dtype == torch.float32
    assert torch.equal(indices_ac, indices)
    assert torch.allclose(weights_ac, weights, rtol=0, atol=1e-6)
