"""The early-fusion model: media scattered into the shared sequence, batching, generation, round trip."""

import pytest
import torch

from kimi_vl.configuration import KimiVLConfig
from kimi_vl.errors import InvalidMediaError, ShapeError
from kimi_vl.modeling import KimiVLForConditionalGeneration
from kimi_vl.text import KimiTextConfig
from kimi_vl.vision import MoonViTConfig

IMG, VID, PAD = 70, 71, 0


def tiny_vl(seed: int = 0) -> KimiVLForConditionalGeneration:
    torch.manual_seed(seed)
    text = KimiTextConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_experts=4,
        num_experts_per_tok=2, kda_head_dim=8, kda_num_heads=2, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )
    vision = MoonViTConfig(hidden_size=24, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32,
                           pos_emb_height=8, pos_emb_width=8)
    model = KimiVLForConditionalGeneration(
        KimiVLConfig(vision_config=vision, text_config=text, image_token_id=IMG, video_token_id=VID)
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "conv" not in name:
                p.normal_(0, 0.2)
    return model


def image(h: int, w: int) -> tuple[torch.Tensor, list[int]]:
    """Random pixels for an `h x w`-patch image and its grid row."""
    return torch.randn(h * w, 3, 14, 14), [1, h, w]


def sample(text_before: list[int], grids: list[list[int]], text_after: list[int], token=IMG) -> list[int]:
    ids = list(text_before)
    for _, h, w in grids:
        ids += [token] * (h * w // 4) + [5]
    return ids + list(text_after)


@torch.no_grad()
def test_logits_equal_manual_scatter_and_backbone():
    model = tiny_vl()
    (pa, ga), (pb, gb) = image(4, 4), image(2, 6)
    ids = torch.tensor([sample([3, 4], [ga, gb], [6, 7, 8])])
    got = model(ids, pixel_values=torch.cat([pa, pb]), image_grid_thw=torch.tensor([ga, gb])).logits

    merged = model.vision_tower(torch.cat([pa, pb]), torch.tensor([ga, gb])).pooler_output
    feats = model.multi_modal_projector(merged)
    embeds = model.get_input_embeddings()(ids).clone()
    embeds[ids == IMG] = feats
    ref = model.language_model(inputs_embeds=embeds).logits
    assert torch.allclose(got, ref, atol=1e-6)
    text_only = model(ids.masked_fill(ids == IMG, 9)).logits
    assert (got - text_only).abs().max() > 1e-2  # the media matter


def test_placeholder_media_mismatch_names_both_counts():
    """The error names both counts and the processor settings that must match the model's (a video processor with
    another `temporal_patch_size` than the vision config's `temporal_chunk_size` writes other counts)."""
    model = tiny_vl()
    p, g = image(4, 4)
    ids = torch.tensor([sample([3], [g], [6])[:-3]])  # one placeholder too few
    with pytest.raises(InvalidMediaError, match=r"3 image placeholder tokens.*4 image tokens.*temporal_patch_size"):
        model(ids, pixel_values=p, image_grid_thw=torch.tensor([g]))
    with pytest.raises(InvalidMediaError, match="0 image placeholder"):
        model(torch.tensor([[3, 4, 5]]), pixel_values=p, image_grid_thw=torch.tensor([g]))


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@torch.no_grad()
def test_batch_with_0_1_and_3_media_equals_each_sample_alone():
    model = tiny_vl()
    media = [[], [image(2, 2)], [image(4, 2), image(2, 4), image(2, 2)]]
    rows = [sample([3, 4, 5], [g for _, g in m], [6, 7]) for m in media]
    ids, mask = _left_pad(rows)
    pixels = torch.cat([p for m in media for p, _ in m])
    grids = torch.tensor([g for m in media for _, g in m])
    batched = model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids).logits
    for i, m in enumerate(media):
        kw = {}
        if m:
            kw = dict(pixel_values=torch.cat([p for p, _ in m]), image_grid_thw=torch.tensor([g for _, g in m]))
        alone = model(torch.tensor([rows[i]]), **kw).logits[0]
        assert (batched[i, -len(rows[i]):] - alone).abs().max() < 1e-4

    kw = dict(attention_mask=mask, pixel_values=pixels, image_grid_thw=grids, max_new_tokens=8, do_sample=False,
              pad_token_id=PAD, eos_token_id=None)
    out = model.generate(ids, **kw)
    for i, m in enumerate(media):
        one = {}
        if m:
            one = dict(pixel_values=torch.cat([p for p, _ in m]), image_grid_thw=torch.tensor([g for _, g in m]))
        alone = model.generate(torch.tensor([rows[i]]), max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                               eos_token_id=None, **one)
        assert torch.equal(out[i, -alone.shape[1]:], alone[0])


def test_generate_checks_the_prompt_ids():
    model = tiny_vl()
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    for ids, match in ((torch.tensor([3, 4]), r"\[B, T\] with T >= 1, got shape \(2,\)"),
                       (torch.zeros(1, 0, dtype=torch.long), r"got shape \(1, 0\)"),
                       (torch.tensor([[3, 80]]), "prompt id 80 is outside the vocabulary"),
                       (torch.tensor([[-1, 3]]), "prompt id -1")):
        with pytest.raises(ShapeError, match=match):
            model.generate(ids, **kw)
    assert model.generate(torch.tensor([[3, 79]]), **kw).shape == (1, 4)
    model.config.image_token_id = 90  # a placeholder past the vocabulary (as K2.5's video placeholder) is fine
    pixels, grid = image(2, 2)
    prompt = torch.tensor([sample([3], [grid], [4], token=90)])
    assert model.generate(prompt, pixel_values=pixels, image_grid_thw=torch.tensor([grid]), **kw).shape == (1, 6)


def test_routers_count_the_media_tokens_but_not_the_padding():
    """The language model sees embeddings only: the pad ids behind a packed row (mask of ones) are found from the
    VL model's input_ids and left out of the routers' expert loads; the media tokens count."""
    model = tiny_vl().train()
    routers = [m.mlp.gate for m in model.language_model.model.layers if hasattr(m.mlp, "gate")]
    pixels, grid = image(2, 4)
    row = sample([3, 4], [grid], [6, 7, 8])
    model(torch.tensor([row + [PAD] * 5]), pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    assert all(r.expert_load.sum() == len(row) * 2 for r in routers)  # real tokens x top-k


@torch.no_grad()
def test_generate_with_images_equals_cache_free_decoding():
    """Greedy `generate` with images in a left-padded prompt batch (preallocated hybrid cache, recurrent KDA,
    absorbed MLA) gives the tokens of repeated cache-free forwards over the same media."""
    model = tiny_vl()
    media = [[image(2, 4)], [image(4, 2), image(2, 2)]]
    rows = [sample([3, 4], [g for _, g in m], [6, 7, 8]) for m in media]
    ids, mask = _left_pad(rows)
    kw = dict(pixel_values=torch.cat([p for m in media for p, _ in m]),
              image_grid_thw=torch.tensor([g for m in media for _, g in m]))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                         eos_token_id=None, suppress_tokens=[IMG, VID], **kw)
    seq, m = ids, mask
    for _ in range(10):
        logits = model(seq, attention_mask=m, use_cache=False, **kw).logits[:, -1]
        nxt = logits.index_fill(-1, torch.tensor([IMG, VID]), float("-inf")).argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_past_key_values_is_taken_as_the_cache_with_images():
    """A prefill's `past_key_values` passed back (transformers' older name for `cache`) continues it."""
    model = tiny_vl()
    p, g = image(2, 2)
    ids = torch.tensor([sample([3], [g], [4, 5, 6, 7])])
    full = model(ids, pixel_values=p, image_grid_thw=torch.tensor([g]), use_cache=False).logits
    out = model(ids[:, :-2], pixel_values=p, image_grid_thw=torch.tensor([g]))
    got = model(ids[:, -2:], past_key_values=out.past_key_values).logits
    assert (got - full[:, -2:]).abs().max() < 1e-4


@torch.no_grad()
def test_continuing_a_cache_takes_only_the_new_tokens_media():
    """A next turn continues the cache with its own media; passing the whole conversation's images again (their
    placeholders already in the cache) says so, instead of only "build inputs with KimiVLProcessor"."""
    model = tiny_vl()
    (p1, g1), (p2, g2) = image(2, 2), image(2, 4)
    turn1 = torch.tensor([sample([3], [g1], [4, 5])])
    turn2 = torch.tensor([sample([6], [g2], [7])])
    full = model(torch.cat([turn1, turn2], 1), pixel_values=torch.cat([p1, p2]), image_grid_thw=torch.tensor([g1, g2]),
                 use_cache=False).logits
    cache = model(turn1, pixel_values=p1, image_grid_thw=torch.tensor([g1])).past_key_values
    got = model(turn2, pixel_values=p2, image_grid_thw=torch.tensor([g2]), cache=cache).logits
    assert (got - full[:, turn1.shape[1]:]).abs().max() < 1e-4
    with pytest.raises(InvalidMediaError, match="continues a cache of .* pass only the media of the new tokens"):
        model(turn2, pixel_values=torch.cat([p1, p2]), image_grid_thw=torch.tensor([g1, g2]), cache=cache)


def test_num_return_sequences_and_beams_repeat_each_samples_own_media():
    """`num_return_sequences` / `num_beams` repeat every sample with its own media: the first step's logits of each
    copy are its sample's (transformers' `repeat_interleave` of the patch and grid rows mixed the samples' media)."""
    model = tiny_vl()
    (p0, g0), (p1, g1), (p2, g2) = image(2, 4), image(4, 2), image(2, 2)
    pv, gv = torch.randn(2 * 4 * 4 + 4 * 4, 3, 14, 14), [[2, 4, 4], [1, 4, 4]]
    rows = [sample([3], [g0], [4]), [3, 4, 5], sample([3], [g1, g2], [4]) + sample([], gv, [6], token=VID)]
    ids, mask = _left_pad(rows)
    kw = dict(attention_mask=mask, pixel_values=torch.cat([p0, p1, p2]), image_grid_thw=torch.tensor([g0, g1, g2]),
              pixel_values_videos=pv, video_grid_thw=torch.tensor(gv))
    with torch.no_grad():
        ref = model(ids, **kw).logits[:, -1].repeat_interleave(2, 0)
    gen = dict(max_new_tokens=2, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True,
               output_logits=True)
    out = model.generate(ids, do_sample=True, num_return_sequences=2, **gen, **kw)
    assert (out.logits[0] - ref).abs().max() < 1e-4
    out = model.generate(ids, num_beams=2, **gen, **kw)
    assert (out.logits[0] - ref).abs().max() < 1e-4


@torch.no_grad()
def test_a_next_turn_with_its_own_image_and_several_replies_continues_the_cache():
    """`generate(whole conversation, cache=turn 1's cache, pixel_values=turn 2's images, num_return_sequences=3)`
    (or beams): the media are matched to the placeholders the cache has not read, and every reply equals the one
    of the same call without a cache over all the conversation's images."""
    model = tiny_vl()
    (p1, g1), (p2, g2), (p3, g3) = image(2, 4), image(2, 2), image(2, 2)
    ids, mask = _left_pad([sample([3, 4], [g1], [6]), [3, 4, 6]])
    kw = dict(pad_token_id=PAD, eos_token_id=None, suppress_tokens=[IMG, VID])
    turn2 = torch.tensor([sample([13], [g2], [14]), sample([13], [g3], [14])])
    new = dict(pixel_values=torch.cat([p2, p3]), image_grid_thw=torch.tensor([g2, g3]))
    every = dict(pixel_values=torch.cat([p1, p2, p3]), image_grid_thw=torch.tensor([g1, g2, g3]))
    for gen in (dict(do_sample=True, num_return_sequences=3), dict(do_sample=False, num_beams=2, num_return_sequences=2)):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                               pixel_values=p1, image_grid_thw=torch.tensor([g1]), **kw)
        seq = torch.cat([first.sequences, turn2], 1)
        mask2 = torch.cat([mask, torch.ones(2, 2 + turn2.shape[1], dtype=torch.long)], 1)
        torch.manual_seed(1)
        got = model.generate(seq, attention_mask=mask2, cache=first.cache, max_new_tokens=4, **gen, **kw, **new)
        torch.manual_seed(1)
        assert torch.equal(got, model.generate(seq, attention_mask=mask2, max_new_tokens=4, **gen, **kw, **every))


@torch.no_grad()
def test_video_and_image_in_one_prompt_with_cache():
    model = tiny_vl()
    pi, gi = image(2, 4)
    pv = torch.randn(2 * 4 * 4 + 4 * 4, 3, 14, 14)  # an 8-frame... as two chunks: t=2 and t=1 at 4x4
    gv = [[2, 4, 4], [1, 4, 4]]
    ids = sample([3], [gi], [4]) + sample([], gv, [6, 7], token=VID)
    ids = torch.tensor([ids])
    kw = dict(pixel_values=pi, image_grid_thw=torch.tensor([gi]), pixel_values_videos=pv,
              video_grid_thw=torch.tensor(gv))
    full = model(ids, use_cache=False, **kw).logits
    assert (full - model(ids.masked_fill(ids == VID, 9), pixel_values=pi, image_grid_thw=torch.tensor([gi]))
            .logits).abs().max() > 1e-2
    out = model(ids[:, :-2], use_cache=True, **kw)
    cache = out.cache
    for t in (ids.shape[1] - 2, ids.shape[1] - 1):  # decode steps carry no pixels
        step = model(ids[:, t : t + 1], cache=cache).logits
        assert (step[:, 0] - full[:, t]).abs().max() < 1e-4


def test_auto_model_for_causal_lm_loads_the_fusion_model_without_remote_code(tmp_path):
    """`import kimi_vl` maps `AutoModelForCausalLM` to the fusion model, as the exported `auto_map` does: a published
    folder loads the installed classes instead of asking to run its remote code."""
    from transformers import AutoModelForCausalLM

    from kimi_vl.export import add_remote_code

    tiny_vl().save_pretrained(tmp_path)
    add_remote_code(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is KimiVLForConditionalGeneration


def test_resize_token_embeddings_grows_the_vocabulary(tmp_path):
    """transformers' `resize_token_embeddings` (tokens added to the tokenizer) resizes the embedding and the LM head
    and the text config's vocabulary, and the resized model saves and reloads."""
    model = tiny_vl()
    p, g = image(2, 2)
    ids = torch.tensor([sample([3], [g], [4, 5])])
    with torch.no_grad():
        ref = model(ids, pixel_values=p, image_grid_thw=torch.tensor([g])).logits
    model.resize_token_embeddings(90)
    assert model.get_input_embeddings().num_embeddings == model.get_output_embeddings().out_features == 90
    assert model.config.text_config.vocab_size == 90
    with torch.no_grad():
        assert torch.equal(model(ids, pixel_values=p, image_grid_thw=torch.tensor([g])).logits[..., :80], ref)
    assert model.generate(torch.tensor([[3, 85]]), max_new_tokens=2, do_sample=False).shape == (1, 4)
    model.save_pretrained(tmp_path)
    assert KimiVLForConditionalGeneration.from_pretrained(tmp_path).get_output_embeddings().out_features == 90


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_loads_with_either_attention_implementation(tmp_path, attn_implementation):
    """`from_pretrained(..., attn_implementation="sdpa")` loads (the vision tower's packed attention is SDPA; it was
    refused as unsupported by MoonViT), with the model's logits."""
    model = tiny_vl()
    model.save_pretrained(tmp_path)
    p, g = image(2, 2)
    ids, kw = torch.tensor([sample([3], [g], [4, 5])]), dict(pixel_values=p, image_grid_thw=torch.tensor([g]))
    loaded = KimiVLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation=attn_implementation)
    with torch.no_grad():
        assert (loaded(ids, **kw).logits - model(ids, **kw).logits).abs().max() < 1e-5


def test_imported_kimi_k25_vision_gives_transformers_media_embeddings(tmp_path):
    from transformers.models.kimi_k25 import configuration_kimi_k25 as hf_config
    from transformers.models.kimi_k25 import modeling_kimi_k25 as hf_model

    from kimi_vl.convert import assemble_kimi_vl, convert_kimi_k25_vision
    from tests.vision.test_moonvit import TEXT, VISION, pixels, randomise

    config = hf_config.Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=64)
    config.vision_config._attn_implementation = "sdpa"
    reference = hf_model.Kimi_K25ForConditionalGeneration(config).eval()
    randomise(reference)
    reference.save_pretrained(tmp_path / "k25")
    convert_kimi_k25_vision(tmp_path / "k25", tmp_path / "moonvit")
    text = tiny_vl().config.text_config
    text.hidden_size = TEXT["hidden_size"]  # the projector's output width
    model = assemble_kimi_vl(tmp_path / "moonvit", text, image_token_id=IMG, video_token_id=VID).eval()
    grids = [[1, 4, 6], [1, 2, 2], [1, 10, 12]]
    px = pixels(grids)
    with torch.no_grad():
        ref = torch.cat(reference.get_image_features(px, torch.tensor(grids)).pooler_output)
        got = model.get_image_features(px, torch.tensor(grids))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_a_checkpoint_without_projector_weights_loads_a_freshly_initialised_projector(tmp_path):
    """transformers leaves uninitialised memory (NaN, 1e14) in missing weights its `_init_weights` calls do not set:
    a projector missing from a checkpoint gets the init a constructed model has; the loaded weights stay as saved."""
    from safetensors.torch import load_file, save_file

    model = tiny_vl()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("multi_modal_projector.")},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = KimiVLForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["missing_keys"]) == sorted(k for k in weights if k.startswith("multi_modal_projector."))
    projector = dict(loaded.multi_modal_projector.named_parameters())
    fresh = dict(KimiVLForConditionalGeneration(model.config).multi_modal_projector.named_parameters())
    for name, p in projector.items():
        assert torch.isfinite(p).all(), name
        assert p.abs().max() <= fresh[name].abs().max() * 1.5 + 1e-6, name  # PyTorch's bounds, not memory garbage
    assert torch.equal(projector["pre_norm.weight"], torch.ones_like(projector["pre_norm.weight"]))
    assert all(torch.equal(p, weights[k]) for k, p in loaded.state_dict().items() if k in weights
               and not k.startswith("multi_modal_projector."))
    assert isinstance(KimiVLForConditionalGeneration.from_pretrained(tmp_path), KimiVLForConditionalGeneration)
