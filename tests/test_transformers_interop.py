"""The models as transformers' own tools drive them: `Trainer`'s loss kwargs, `return_dict`, config kwargs, generation
in train mode, adapters under activation checkpointing."""

import pytest
import torch
import torch.nn.functional as F

from kimi_vl.errors import ConfigError
from kimi_vl.text.modeling import chunked_causal_lm_loss
from tests.test_modeling import image, tiny_vl
from tests.text.test_model import tiny_config, tiny_model


def test_num_items_in_batch_makes_accumulated_micro_batches_the_global_token_mean():
    """transformers' `Trainer` passes `num_items_in_batch` (the targets of the whole accumulated batch) to models whose
    forward takes `**kwargs`, and then does not divide the loss by the accumulation steps: the loss must be the sum of
    the micro-batch's token losses over it (it was ignored: every accumulated gradient came out `steps` times too big).
    """
    model = tiny_model()
    torch.manual_seed(0)
    ids = torch.randint(3, 61, (3, 9))
    labels = ids.clone()
    labels[0, :6] = -100  # micro-batches with unequal target counts
    full = model(ids, labels=labels).loss
    n = int((labels[:, 1:] != -100).sum())
    parts = [model(ids[s], labels=labels[s], num_items_in_batch=torch.tensor(n)).loss for s in (slice(0, 1), slice(1, 3))]
    torch.testing.assert_close(parts[0] + parts[1], full)

    logits = model(ids).logits
    by_hand = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels[:, 1:].flatten(), reduction="sum") / 40
    torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=40).loss.double(), by_hand)
    hidden = model.model(ids).last_hidden_state
    chunked = chunked_causal_lm_loss(hidden, model.lm_head, labels, max_elements=100, num_items_in_batch=40)
    torch.testing.assert_close(chunked.double(), by_hand)

    vl = tiny_vl()
    torch.testing.assert_close(vl(ids, labels=labels, num_items_in_batch=40).loss,
                               vl(ids, labels=labels).loss * n / 40)  # the early-fusion model passes it on
    with pytest.raises(ConfigError, match="num_items_in_batch"):
        model(ids[:1], labels=labels[:1], cu_seqlens=torch.tensor([0, 4, 9]), loss_normalisation="document",
              num_items_in_batch=5)


def test_transformers_trainer_gradient_accumulation_equals_one_big_batch(tmp_path):
    """One SGD step of transformers' `Trainer` over 2 sequences: 2 micro-batches of 1 accumulated give the update of
    one batch of 2."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 61, (2, 8))]

    def update(batch: int, accumulation: int) -> torch.Tensor:
        model = tiny_model().train()
        before = model.lm_head.weight.detach().clone()
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{batch}"), per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
            lr_scheduler_type="constant", max_grad_norm=0, report_to=[], use_cpu=True, save_strategy="no",
            disable_tqdm=True,
        )
        Trainer(model=model, args=args, train_dataset=rows).train()
        return before - model.lm_head.weight.detach()

    torch.testing.assert_close(update(1, 2), update(2, 1))



def test_router_balancing_callback_updates_the_biases_under_transformers_trainer(tmp_path):
    """`Trainer` never calls the aux-loss-free update; `RouterBalancingCallback` moves every router's bias by the rate
    times sign(mean load - load) of the tokens its accumulated batch routed, once per optimizer step."""
    from transformers import Trainer, TrainingArguments

    from kimi_vl.training import RouterBalancingCallback

    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 61, (2, 8))]
    model = tiny_model().train()
    for row in rows:  # the loads the step's two micro-batches count (the learning rate is 0: the same forwards)
        model(row["input_ids"][None])
    routers = [m for m in model.modules() if hasattr(m, "expert_load")]
    loads = [r.expert_load.clone() for r in routers]

    def biases(callbacks: list) -> list[torch.Tensor]:
        for r in routers:
            r.expert_load.zero_()
            r.e_score_correction_bias.zero_()
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
            learning_rate=0.0, optim="sgd", report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks).train()
        return [r.e_score_correction_bias.clone() for r in routers]

    assert all(not b.any() for b in biases([]))
    callback = RouterBalancingCallback(rate=0.01)
    for got, load in zip(biases([callback]), loads, strict=True):
        torch.testing.assert_close(got, 0.01 * torch.sign(load.mean() - load))
    assert len(callback.balancing.last_loads) == len(routers)


@pytest.mark.parametrize("which", ["causal_lm", "backbone", "vl"])
def test_return_dict_false_returns_transformers_tuple(which):
    """`return_dict=False` (argument or `config.return_dict`) gives the output's `to_tuple()`, as transformers' models
    do (it was accepted and ignored); generation and the models' calls of their submodels are unaffected."""

    model = {"causal_lm": tiny_model, "backbone": lambda: tiny_model().model, "vl": tiny_vl}[which]()
    ids = torch.tensor([[3, 4, 5, 6]])
    kwargs = {} if which == "backbone" else {"labels": ids}
    ref = model(ids, **kwargs).to_tuple()
    generated = None if which == "backbone" else model.generate(ids, max_new_tokens=3, do_sample=False)
    got = model(ids, return_dict=False, **kwargs)
    assert isinstance(got, tuple) and len(got) == len(ref) == (2 if which == "backbone" else 3)
    torch.testing.assert_close(got[:-1], ref[:-1])  # the last item is the cache
    model.config.return_dict = False
    assert isinstance(model(ids, **kwargs), tuple)
    torch.testing.assert_close(model(ids, return_dict=True, **kwargs).to_tuple()[:-1], ref[:-1])
    if generated is not None:
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), generated)


@pytest.mark.parametrize("tie", [True, False])
def test_vl_config_tie_word_embeddings_is_the_language_models(tie, tmp_path):
    """`KimiVLConfig(..., tie_word_embeddings=...)` decides whether the model's head is tied (the language model read
    only `text_config`'s: the config said tied and the model was not, or the reverse), also after a save and load."""
    from kimi_vl.configuration import KimiVLConfig
    from kimi_vl.modeling import KimiVLForConditionalGeneration
    from kimi_vl.vision import MoonViTConfig


    vision = MoonViTConfig(hidden_size=8, num_attention_heads=1, num_hidden_layers=1, intermediate_size=8,
                           pos_emb_height=4, pos_emb_width=4)
    config = KimiVLConfig(vision_config=vision, text_config=tiny_config(tie_word_embeddings=not tie),
                          image_token_id=70, video_token_id=71, tie_word_embeddings=tie, pad_token_id=3)
    assert config.text_config.tie_word_embeddings is tie and config.text_config.pad_token_id == 3
    model = KimiVLForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    for m in (model, KimiVLForConditionalGeneration.from_pretrained(tmp_path)):
        shared = m.get_input_embeddings().weight.data_ptr() == m.get_output_embeddings().weight.data_ptr()
        assert shared is tie and m.config.tie_word_embeddings is tie


def test_vl_config_overrides_of_from_pretrained_reach_the_language_model(tmp_path):
    """`from_pretrained(d, pad_token_id=..., tie_word_embeddings=...)` sets its overrides on the loaded config after
    construction: they reach `text_config`, which the language model reads, as the constructor's do (the model said
    `pad_token_id=7` while its routers still took 0 for padding)."""
    from transformers import AutoConfig

    from kimi_vl.modeling import KimiVLForConditionalGeneration

    tiny_vl().save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, pad_token_id=7, eos_token_id=[2, 5], tie_word_embeddings=True)
    text = config.text_config
    assert (text.pad_token_id, text.eos_token_id, text.tie_word_embeddings) == (7, [2, 5], True)
    model = KimiVLForConditionalGeneration.from_pretrained(tmp_path, pad_token_id=7)
    assert model.language_model.config.pad_token_id == model.config.pad_token_id == 7
    model.config.bos_token_id = 4
    assert model.language_model.config.bos_token_id == 4


@pytest.mark.parametrize("which", ["causal_lm", "vl"])
def test_generate_in_train_mode_with_gradient_checkpointing(which):
    """TRL's trainers generate their rollouts while the model is in train mode with gradient checkpointing on: under
    `no_grad` nothing is recomputed, so the cache is safe (this raised ConfigError). A training forward that asks for
    a cache is still refused."""

    model = tiny_model() if which == "causal_lm" else tiny_vl()
    ids = torch.tensor([[3, 4, 5]])
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": False})  # transformers' gradient_checkpointing_enable
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    with pytest.raises(ConfigError, match="gradient checkpointing"):
        model(ids, use_cache=True)


def test_adapters_in_a_frozen_vision_tower_get_gradients_under_reentrant_checkpointing():
    """PEFT's recipe: freeze the model, `enable_input_require_grads()`, reentrant activation checkpointing, train a
    few matrices (here one in the vision tower, one in the language model). The vision tower's got no gradient (its
    checkpointed blocks saw no input needing one) until it exposed its patch embedding as `get_input_embeddings`."""

    pixels, grid = image(4, 4)
    ids = torch.tensor([[3, 4] + [70] * 4 + [5, 6]])

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model = tiny_vl().train()
        model.requires_grad_(False)
        trained = [model.vision_tower.layers[1].attn.qkv.weight, model.language_model.model.layers[2].self_attn.o_proj.weight]
        for p in trained:
            p.requires_grad_(True)
        if checkpointing:
            model.enable_input_require_grads()
            model.activation_checkpointing_enable({"use_reentrant": True})
        model(ids, labels=ids, pixel_values=pixels, image_grid_thw=torch.tensor([grid])).loss.backward()
        return [p.grad for p in trained]

    expected = grads(checkpointing=False)
    got = grads(checkpointing=True)
    assert all(g is not None for g in got)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("which", ["causal_lm", "vl"])
def test_config_output_flags_are_read_as_transformers_models_read_them(which, tmp_path):
    """`from_pretrained(..., output_hidden_states=True)` sets `config.output_hidden_states`, which transformers' models
    read when the argument is not given: the hidden states came back None. `config.output_attentions` (set the same
    way) is refused as the argument is, not answered with None."""
    model = tiny_model() if which == "causal_lm" else tiny_vl()
    ids = torch.tensor([[3, 4, 5, 6]])
    expected = model(ids, output_hidden_states=True).hidden_states
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, output_hidden_states=True)
    got = loaded(ids).hidden_states
    assert got is not None and len(got) == len(expected) == model.config.get_text_config().num_hidden_layers + 1
    torch.testing.assert_close(got, expected)
    assert loaded(ids, output_hidden_states=False).hidden_states is None
    loaded = type(model).from_pretrained(tmp_path, output_attentions=True)
    with pytest.raises(ConfigError, match="output_attentions"):
        loaded(ids)


@pytest.mark.parametrize("which", ["causal_lm", "vl"])
def test_logits_to_keep_takes_a_tensor_of_positions_as_in_transformers(which):
    """transformers' `logits_to_keep` is an int (the last positions) or a 1-D tensor of the positions to keep; the
    tensor raised "Boolean value of Tensor with more than one value is ambiguous"."""
    model = tiny_model() if which == "causal_lm" else tiny_vl()
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    full = model(ids).logits
    keep = torch.tensor([0, 3])
    got = model(ids, logits_to_keep=keep).logits
    assert got.shape == (2, 2, full.shape[-1])
    torch.testing.assert_close(got, full[:, keep])
    torch.testing.assert_close(model(ids, logits_to_keep=2).logits, full[:, -2:])


def test_vl_get_decoder_is_the_headless_text_backbone():
    """transformers' `get_decoder()` gives the decoder that returns hidden states (a vision-language model's headless
    language model); the fusion model's returned its language model with the LM head."""
    from kimi_vl.text import KimiTextModel

    model = tiny_vl()
    decoder = model.get_decoder()
    assert decoder is model.language_model.model and isinstance(decoder, KimiTextModel)
    ids = torch.tensor([[3, 4, 5, 6]])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(decoder(ids).last_hidden_state, hidden)
    other = tiny_vl(seed=1).get_decoder()
    model.set_decoder(other)
    assert model.get_decoder() is other
