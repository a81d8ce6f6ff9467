"""A whole released-layout Kimi VLM imported with `convert_kimi_k25`: parity with transformers'
`Kimi_K25ForConditionalGeneration` (tiny random config, saved by transformers in the released key layout, sharded,
with a processor), Auto loading, Block AttnRes from zero queries, fine-tuning with MuonClip, the training stages,
and bad input."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.kimi_k25 import (
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    Kimi_K25ImageProcessor,
    Kimi_K25Processor,
    Kimi_K25VideoProcessor,
)

import kimi_vl  # noqa: F401  (registers the Auto classes)
from kimi_vl.cli import main
from kimi_vl.convert import convert_kimi_k25
from kimi_vl.errors import CheckpointError
from kimi_vl.modeling import KimiVLForConditionalGeneration
from kimi_vl.tokenization import build_tokenizer
from kimi_vl.training import MuonClip
from tests.parity.test_deepseek_v3 import YARN, randomise

TOL = 1e-4
TEXTS = [f"Item {i} costs {3 * i} coins; {i} plus {i} is {2 * i}. The {'red' if i % 2 else 'blue'} box." for i in
         range(200)]


def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=360)


def k25_config(tok, *, tie: bool = False) -> Kimi_K25Config:
    image, video = tok.convert_tokens_to_ids(["<|media_pad|>", "<|kimi_k25_video_placeholder|>"])
    start, end = tok.convert_tokens_to_ids(["<|media_start|>", "<|media_end|>"])
    text = dict(
        model_type="deepseek_v3", vocab_size=len(tok), hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=16, q_lora_rank=12,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=6, num_experts_per_tok=2, n_group=3,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, rope_parameters=YARN,
        max_position_embeddings=128, tie_word_embeddings=tie, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    vision = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64, pos_emb_height=8,
                  pos_emb_width=8)
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32, image_token_id=image,
                          video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                          tie_word_embeddings=tie)


def reference_model(tok, *, tie: bool = False, seed: int = 0) -> Kimi_K25ForConditionalGeneration:
    config = k25_config(tok, tie=tie)
    config.vision_config._attn_implementation = "sdpa"
    model = Kimi_K25ForConditionalGeneration(config).eval()
    randomise(model, seed)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """transformers' model saved (released key layout, 5 shards) with a Kimi_K25Processor holding a kimi-vl BPE
    tokenizer, then converted."""
    tok = tokenizer()
    reference = reference_model(tok)
    root = tmp_path_factory.mktemp("k25")
    reference.save_pretrained(root / "src", max_shard_size="100KB")
    Kimi_K25Processor(image_processor=Kimi_K25ImageProcessor(max_patches=300), tokenizer=tok,
                      video_processor=Kimi_K25VideoProcessor()).save_pretrained(root / "src")
    convert_kimi_k25(root / "src", root / "dst", max_shard_bytes=300_000)
    ours = AutoModelForImageTextToText.from_pretrained(root / "dst").eval()
    return reference, ours, root


def pixels(grids, seed):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def media_ids(config, grids, token, merge=4):
    """Placeholder tokens of each media (one per merged token) between `<|media_start|>` / `<|media_end|>`."""
    ids = []
    for _, h, w in grids:
        ids += [config.vision_start_token_id] + [token] * (h * w // merge) + [config.vision_end_token_id]
    return ids


def multi_image_inputs(config):
    grids = [[1, 4, 6], [1, 8, 8], [1, 2, 2]]  # three images, three grids (8x8 = the position table)
    ids = [150, 161, 172] + media_ids(config, grids, config.image_token_id) + [220, 231, 107, 244]
    return dict(input_ids=torch.tensor([ids]), pixel_values=pixels(grids, 1), image_grid_thw=torch.tensor(grids))


def video_and_image_inputs(config):
    video = [[4, 4, 6], [4, 4, 6]]  # an 8-frame video: two 4-frame chunks
    image = [[1, 6, 4]]
    ids = ([108, 103] + media_ids(config, video, config.video_token_id) + [115]
           + media_ids(config, image, config.image_token_id) + [127, 109])
    return dict(input_ids=torch.tensor([ids]), pixel_values=pixels(image, 2), image_grid_thw=torch.tensor(image),
                pixel_values_videos=pixels(video, 3), video_grid_thw=torch.tensor(video))


def reference_logits(reference, batch):
    """transformers' logits. Its `get_video_features` splits the features by `prod(grid) // 4`, wrong for the
    multi-frame chunks of a video (their tokens are pooled over time), so video features come from its own vision
    tower and projector through `mm_encoder_outputs` (how the existing vision parity tests call it)."""
    if "pixel_values_videos" not in batch:
        return reference(**batch).logits
    model = reference.model
    pooled = model.vision_tower(batch["pixel_values_videos"], grid_thw=batch["video_grid_thw"]).pooler_output
    video = BaseModelOutputWithPooling(pooler_output=(model.mm_projector(pooled).squeeze(1),))
    image = model.get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True)
    return reference(input_ids=batch["input_ids"], mm_encoder_outputs={"image": image, "video": video}).logits


def test_auto_loading_config_and_processor(converted):
    reference, ours, root = converted
    assert type(ours) is KimiVLForConditionalGeneration
    text, ref = ours.config.text_config, reference.config
    assert text.layer_types == ["mla_rope", "mla_rope"] and text.residual == "standard"
    assert text.first_k_dense == 1 and (text.n_group, text.topk_group) == (3, 2) and text.q_lora_rank == 12
    assert text.rope_parameters["rope_type"] == "yarn" and text.rope_parameters["mscale_all_dim"] == 0.7
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(ours.config, name) == getattr(ref, name), name
    assert len(list((root / "src").glob("*.safetensors"))) > 1 and len(list((root / "dst").glob("*.safetensors"))) > 1
    processor = AutoProcessor.from_pretrained(root / "dst")
    assert type(processor).__name__ == "KimiVLProcessor" and processor.image_processor.max_patches == 300
    assert (processor.image_token_id, processor.video_token_id) == (ref.image_token_id, ref.video_token_id)


@torch.no_grad()
@pytest.mark.parametrize("inputs", [multi_image_inputs, video_and_image_inputs])
def test_logits_match_transformers(converted, inputs):
    reference, ours, _ = converted
    batch = inputs(reference.config)
    ref = reference_logits(reference, batch)
    got = ours(**batch).logits
    assert (got - ref).abs().max() < TOL
    assert ref.std() > 0.5
    ids = batch["input_ids"]
    placeholders = (ids == reference.config.image_token_id) | (ids == reference.config.video_token_id)
    assert (ours(ids.masked_fill(placeholders, 150)).logits - got).abs().max() > 1e-2  # the media matter


@torch.no_grad()
def test_greedy_generation_matches_transformers(converted):
    reference, ours, _ = converted
    batch = multi_image_inputs(reference.config)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = reference.generate(**batch, **kw)
    got = ours.generate(**batch, **kw)
    assert got.shape[1] == batch["input_ids"].shape[1] + 16
    assert torch.equal(got, ref)


def test_block_attnres_conversion_equals_standard(converted, tmp_path):
    _, ours, root = converted
    assert main(["convert", "kimi-k25", str(root / "src"), str(tmp_path / "attnres"), "--residual",
                 "block_attnres"]) == 0
    attnres = KimiVLForConditionalGeneration.from_pretrained(tmp_path / "attnres").eval()
    assert attnres.config.text_config.residual == "block_attnres"
    with safe_open(str(tmp_path / "attnres" / "model.safetensors"), "pt") as f:  # written, not left to init
        assert "language_model.model.residual.final_query" in f.keys()
    batch = video_and_image_inputs(ours.config)
    with torch.no_grad():
        torch.testing.assert_close(attnres(**batch).logits, ours(**batch).logits, rtol=0, atol=1e-5)


def test_muonclip_fine_tuning_and_reload(converted, tmp_path):
    """A few MuonClip steps on images + text (QK-Clip records every RoPE-MLA and MoonViT head), saved and reloaded."""
    _, _, root = converted
    model = KimiVLForConditionalGeneration.from_pretrained(root / "dst")
    model.train()
    opt = MuonClip(model, lr=3e-3, qk_clip_tau=5.0)
    batch = multi_image_inputs(model.config)
    losses = []
    for _ in range(3):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert {"language_model.model.layers.0.self_attn", "language_model.model.layers.1.self_attn"} <= set(
        opt.last_max_logits)
    model.save_pretrained(tmp_path / "tuned")
    again = KimiVLForConditionalGeneration.from_pretrained(tmp_path / "tuned")
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name


def test_training_stages_start_from_the_converted_model(converted, tmp_path):
    from kimi_vl.training.stages import read_summary, rl, sft

    _, _, root = converted
    out = sft(root / "dst", tmp_path / "sft", steps=2, progress=False, val_batches=1)
    assert read_summary(out)["complete"]
    out = rl(out, tmp_path / "rl", steps=1, progress=False, prompts_per_family=1, k=2, max_new_tokens=4)
    model = KimiVLForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.layer_types == ["mla_rope", "mla_rope"]


def test_tied_head(tmp_path):
    tok = tokenizer()
    reference = reference_model(tok, tie=True, seed=4)
    reference.save_pretrained(tmp_path / "src")
    convert_kimi_k25(tmp_path / "src", tmp_path / "dst")
    ours = KimiVLForConditionalGeneration.from_pretrained(tmp_path / "dst").eval()
    assert ours.config.tie_word_embeddings
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    batch = multi_image_inputs(reference.config)
    with torch.no_grad():
        assert (ours(**batch).logits - reference(**batch).logits).abs().max() < TOL


def test_bad_input_names_the_problem_and_leaves_nothing(converted, tmp_path):
    _, _, root = converted
    out = tmp_path / "out"

    def leftovers():
        return [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]

    with pytest.raises(CheckpointError, match="config.json"):
        convert_kimi_k25(tmp_path / "missing", out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(CheckpointError, match="model_type='deepseek_v3'.*convert deepseek-v3"):
        convert_kimi_k25(other, out)
    assert main(["convert", "kimi-k25", str(other), str(out)]) == 2

    # One shard missing: named from the index; without the index, the tensors it held are named.
    partial = tmp_path / "partial"
    partial.mkdir()
    victim = sorted((root / "src").glob("*.safetensors"))[1]
    for f in (root / "src").iterdir():
        if f != victim:
            (partial / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=f"missing: \\['{victim.name}'\\]"):
        convert_kimi_k25(partial, out)
    (partial / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="missing \\['"):
        convert_kimi_k25(partial, out)
    # A quantized tensor is refused with what to do.
    save_file({"language_model.model.layers.1.mlp.experts.0.up_proj.weight_scale_inv": torch.ones(1)},
              str(partial / victim.name))
    with pytest.raises(CheckpointError, match="Dequantize"):
        convert_kimi_k25(partial, out)
    assert not out.exists() and not leftovers()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_kimi_k25(root / "src", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not leftovers()


def test_released_remote_code_vision_config(converted, tmp_path):
    """The released repos' config.json names the MoonViT sizes as their remote code does (`vt_hidden_size`,
    `init_pos_emb_height`, `projector_ln_eps`, `mm_hidden_size`, ...), not as transformers' `Kimi_K25VisionConfig`:
    those names are read, not replaced by the full-size defaults."""
    import shutil

    from kimi_vl.convert import convert_kimi_k25_vision
    from kimi_vl.vision import MoonViTModel

    reference, ours, root = converted
    src = tmp_path / "released"
    shutil.copytree(root / "src", src)
    raw = json.loads((src / "config.json").read_text())
    v = raw.pop("vision_config")
    raw.pop("projection_hidden_size"), raw.pop("projection_layer_norm_eps")
    raw["vision_config"] = {
        "vt_hidden_size": v["hidden_size"], "vt_num_attention_heads": v["num_attention_heads"],
        "vt_num_hidden_layers": v["num_hidden_layers"], "vt_intermediate_size": v["intermediate_size"],
        "init_pos_emb_height": v["pos_emb_height"], "init_pos_emb_width": v["pos_emb_width"],
        "init_pos_emb_time": v["pos_emb_time"], "merge_kernel_size": v["merge_kernel_size"], "patch_size": 14,
        "mm_hidden_size": v["hidden_size"], "projector_ln_eps": 1e-5, "model_type": "",
        "text_hidden_size": raw["text_config"]["hidden_size"], "pos_emb_type": "divided_fixed",
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "video_attn_type": "spatial_temporal",
    }
    (src / "config.json").write_text(json.dumps(raw))
    convert_kimi_k25(src, tmp_path / "dst")
    released = KimiVLForConditionalGeneration.from_pretrained(tmp_path / "dst").eval()
    assert released.config.vision_config.to_dict() == ours.config.vision_config.to_dict()
    batch = multi_image_inputs(reference.config)
    with torch.no_grad():
        assert (released(**batch).logits - reference_logits(reference, batch)).abs().max() < TOL
    convert_kimi_k25_vision(src, tmp_path / "vision")
    assert MoonViTModel.from_pretrained(tmp_path / "vision").config.hidden_size == v["hidden_size"]
