"""Parity with transformers' own `KimiLinearForCausalLM`: tiny random configs saved, converted, loaded."""

import json

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from kimi_vl.convert import convert_kimi_linear
from kimi_vl.errors import CheckpointError
from kimi_vl.text import KimiTextForCausalLM

CONFIGS = {
    # MoE with shared experts, first layer dense, two MLA layers (1 and 3), varied head sizes.
    "hybrid": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_hidden_layers=4, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        linear_head_dim=16, linear_num_heads=2,
    ),
    # Two shared experts, grouped routing, two dense layers, q LoRA, three KDA layers then MLA.
    "grouped": dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"] * 2,
        num_hidden_layers=5, num_local_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        n_group=2, topk_group=1, first_k_dense_replace=2, q_lora_rank=24, linear_head_dim=8, linear_num_heads=4,
    ),
    # MLA biases, a saved head under tie_word_embeddings (transformers' model never ties it), eps far from 1e-6.
    "biased_untied_head": dict(
        layer_types=["full_attention", "linear_attention", "full_attention"], num_hidden_layers=3,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, attention_bias=True, tie_word_embeddings=True,
        q_lora_rank=16, rms_norm_eps=0.1, linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=2,
    ),
    # transformers' defaults for num_key_value_heads (32, whatever the head count) and n_shared_experts=0 (zero-width
    # shared experts), layers given as the released `linear_attn_config`, no dense layer, no renormalisation.
    "no_shared_experts": dict(
        num_key_value_heads=32, linear_attn_config=dict(kda_layers=[2], full_attn_layers=[1, 3], head_dim=8,
                                                        num_heads=2, short_conv_kernel_size=3),
        num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=3, n_shared_experts=0, first_k_dense_replace=0,
        norm_topk_prob=False,
    ),
}


def _hf_model(name: str, seed: int = 0) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(**{
        **dict(vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_attention_heads=3,
               num_key_value_heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, routed_scaling_factor=2.446),
        **CONFIGS[name],
    })
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # weights large enough that every path matters; non-zero biases and router bias
        for pname, p in model.named_parameters():
            if p.ndim >= 2 and "conv" not in pname:
                p.normal_(0, 0.15)
            elif pname.endswith(".bias"):
                p.normal_(0, 0.1)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf = _hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf")
    convert_kimi_linear(root / "hf", root / "ours")
    ours = KimiTextForCausalLM.from_pretrained(root / "ours").eval()
    return hf, ours


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 77), generator=g)  # 77: not a multiple of a chunk (32 or 64 tokens)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    mask[2, :30] = 0
    ids[mask == 0] = 0
    return ids, mask


@torch.no_grad()
def test_logits_and_loss_match_transformers(pair):
    hf, ours = pair
    ids, mask = _padded_batch()
    ref = hf(ids, attention_mask=mask).logits
    got = ours(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (got[valid] - ref[valid]).abs().max() < 1e-4
    assert ref.std() > 0.1  # the comparison is not between near-constant outputs

    # -100 on pads and on each first real token (its prediction would come from a pad position).
    labels = ids.masked_fill((mask == 0) | (mask.cumsum(1) == 1), -100)
    assert torch.allclose(ours(ids, attention_mask=mask, labels=labels).loss,
                          hf(ids, attention_mask=mask, labels=labels).loss, rtol=0, atol=1e-5)


@torch.no_grad()
def test_greedy_generate_matches_transformers_and_cache_free_forward(pair):
    hf, ours = pair
    ids, mask = _padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(ids, **kw)
    got = ours.generate(ids, **kw)
    assert torch.equal(got, ref)
    # The same tokens from repeated cache-free forwards.
    seq, m = ids, mask
    for _ in range(20):
        nxt = ours(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(seq, got)


def test_released_layout_and_sharding(tmp_path):
    """The released remote-code layout (per-expert w1/w2/w3, dense FFN under `mlp.`) split across shards."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model("hybrid")
    hf.save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    state = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in state.items()}
    keys = sorted(state)
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file({k: state[k] for k in keys[::2]}, tmp_path / "hf" / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in keys[1::2]}, tmp_path / "hf" / "model-00002-of-00002.safetensors")
    convert_kimi_linear(tmp_path / "hf", tmp_path / "ours", max_shard_bytes=200_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    ours = KimiTextForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids, mask = _padded_batch()
    with torch.no_grad():
        ref = hf.eval()(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert (got[mask.bool()] - ref[mask.bool()]).abs().max() < 1e-4


def test_convert_rejects_bad_input(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="config.json") as error:
        convert_kimi_linear(tmp_path, tmp_path / "out")
    assert "Hub" not in str(error.value)
    monkeypatch.chdir(tmp_path)  # a Hub id, not a local folder: how to import it
    with pytest.raises(CheckpointError, match=r"`huggingface-cli download moonshotai/Kimi-Linear-48B-A3B-Instruct "
                                              r"--local-dir DIR`"):
        convert_kimi_linear("moonshotai/Kimi-Linear-48B-A3B-Instruct", tmp_path / "out")
    (tmp_path / "config.json").write_text('{"model_type": "kimi_k25"}')
    with pytest.raises(CheckpointError, match="model_type='kimi_k25'.*Use `kimi-vl convert kimi-k25`"):
        convert_kimi_linear(tmp_path, tmp_path / "out")
    gelu = _hf_model("hybrid")
    gelu.config.hidden_act = "gelu"  # transformers' model would use it in its FFNs and KDA short convs
    gelu.save_pretrained(tmp_path / "gelu")
    with pytest.raises(CheckpointError, match="hidden_act='gelu'"):
        convert_kimi_linear(tmp_path / "gelu", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("residual, block", [("block_attnres", 2), ("block_attnres", 6), ("attnres", 1)])
def test_converted_checkpoint_with_zero_query_attnres_matches_transformers(tmp_path, residual, block):
    hf = _hf_model("hybrid")
    hf.save_pretrained(tmp_path / "hf")
    convert_kimi_linear(tmp_path / "hf", tmp_path / "ours")
    ours = KimiTextForCausalLM.from_pretrained(tmp_path / "ours", residual=residual,
                                               attnres_block_size=block).eval()
    assert ours.config.residual == residual
    ids, mask = _padded_batch()
    with torch.no_grad():
        ref = hf.eval()(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert (got[mask.bool()] - ref[mask.bool()]).abs().max() < 1e-4


def test_convert_writes_each_shard_when_full(tmp_path, monkeypatch):
    """Memory: a shard is written as soon as it is full, so the tensors read and not yet written never exceed about
    one shard (the model of a 48B checkpoint never sits in memory at once)."""
    import kimi_vl.convert as convert

    hf = _hf_model("hybrid")
    hf.save_pretrained(tmp_path / "hf")
    held = {"read": 0, "written": 0, "peak": 0}
    get, save = convert._Source.get, convert.save_file

    def counting_get(self, key):
        t = get(self, key)
        held["read"] += t.numel() * t.element_size()
        held["peak"] = max(held["peak"], held["read"] - held["written"])
        return t

    def counting_save(tensors, *args, **kwargs):
        held["written"] += sum(t.numel() * t.element_size() for t in tensors.values())
        return save(tensors, *args, **kwargs)

    monkeypatch.setattr(convert._Source, "get", counting_get)
    monkeypatch.setattr(convert, "save_file", counting_save)
    shard = 50_000
    convert_kimi_linear(tmp_path / "hf", tmp_path / "ours", max_shard_bytes=shard)
    largest = max(p.numel() * p.element_size() for p in hf.state_dict().values())
    assert held["written"] > 5 * shard and held["peak"] <= shard + 2 * largest
    ours = KimiTextForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids, mask = _padded_batch()
    with torch.no_grad():
        ref, got = hf(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert (got[mask.bool()] - ref[mask.bool()]).abs().max() < 1e-4


def test_convert_into_an_existing_folder_needs_overwrite_and_never_mixes_checkpoints(tmp_path, capsys):
    """A second conversion into a folder refuses to write over it, and with `overwrite` replaces it whole: an old
    `model.safetensors` beside new shards and their index would load the old weights."""
    from kimi_vl.cli import main

    first, second = _hf_model("hybrid", seed=0), _hf_model("hybrid", seed=1)
    first.save_pretrained(tmp_path / "first")
    second.save_pretrained(tmp_path / "second")
    dst = tmp_path / "ours"
    convert_kimi_linear(tmp_path / "first", dst)  # one file: model.safetensors
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        convert_kimi_linear(tmp_path / "second", dst, max_shard_bytes=100_000)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert main(["convert", "kimi-linear", str(tmp_path / "second"), str(dst), "--overwrite"]) in (None, 0)
    convert_kimi_linear(tmp_path / "second", dst, max_shard_bytes=100_000, overwrite=True)  # sharded now
    assert not (dst / "model.safetensors").exists() and (dst / "model.safetensors.index.json").is_file()
    assert not list(tmp_path.glob(".ours.*"))  # no temporary folders left
    ours = KimiTextForCausalLM.from_pretrained(dst).eval()
    ids, mask = _padded_batch()
    with torch.no_grad():
        ref, got = second.eval()(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert (got[mask.bool()] - ref[mask.bool()]).abs().max() < 1e-4


def test_convert_over_its_own_source_is_refused_even_with_overwrite(tmp_path):
    """`--overwrite` replaces the destination whole: a destination that is the source, or a folder holding it,
    would lose the source (and everything beside it), so it is refused before anything is written."""
    src = tmp_path / "downloads" / "kimi-linear"
    _hf_model("hybrid", seed=0).save_pretrained(src)
    (tmp_path / "downloads" / "other.txt").write_text("x")
    before = sorted(p.name for p in src.iterdir())
    for dst in (src, src.parent, tmp_path):
        with pytest.raises(CheckpointError, match="is or holds the source .* would delete the source"):
            convert_kimi_linear(src, dst, overwrite=True)
    assert sorted(p.name for p in src.iterdir()) == before and (tmp_path / "downloads" / "other.txt").is_file()


REMOTE_TOKENIZER = '''
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}

    def __init__(self, vocab_file, **kwargs):
        self.letters = {chr(97 + i): i + 3 for i in range(26)}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 97

    def get_vocab(self):
        return dict(self.letters)

    def _tokenize(self, text):
        return [c for c in text if c in self.letters]

    def _convert_token_to_id(self, token):
        return self.letters.get(token, 0)

    def _convert_id_to_token(self, index):
        return chr(94 + index)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def test_remote_code_tokenizer_of_a_released_repo_loads_from_the_conversion(tmp_path):
    """The released repos ship their tokenizer as remote code (`tiktoken.model`, `tokenizer_config.json` whose
    `auto_map` names `tokenization_kimi.TikTokenTokenizer`, `tokenization_kimi.py`): the module is carried with the
    other tokenizer files, so the tokenizer loads from the converted directory as it does from the source."""
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    _hf_model("hybrid").save_pretrained(src)
    (src / "tokenization_kimi.py").write_text(REMOTE_TOKENIZER)
    (src / "tiktoken.model").write_text("ranks")
    (src / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    convert_kimi_linear(src, tmp_path / "dst")
    tok = AutoTokenizer.from_pretrained(tmp_path / "dst", trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and tok("abc").input_ids == [3, 4, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "ab<|im_end|>"


def test_remote_code_tokenizer_helpers_imported_relatively_are_carried(tmp_path):
    """The released K2 / K2.5 `tokenization_kimi.py` imports `.tool_declaration_ts`: that module (and what it imports
    in turn) is carried too, or transformers cannot load the tokenizer from the converted directory."""
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    _hf_model("hybrid").save_pretrained(src)
    (src / "tokenization_kimi.py").write_text("from .tool_declaration_ts import encode_tools\n" + REMOTE_TOKENIZER)
    (src / "tool_declaration_ts.py").write_text("from .ts_types import NAME\n\n\ndef encode_tools(tools):\n"
                                                "    return NAME + str(tools)\n")
    (src / "ts_types.py").write_text("NAME = 'ts'\n")
    (src / "tiktoken.model").write_text("ranks")
    (src / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    convert_kimi_linear(src, tmp_path / "dst")
    assert {"tool_declaration_ts.py", "ts_types.py"} <= {p.name for p in (tmp_path / "dst").iterdir()}
    tok = AutoTokenizer.from_pretrained(tmp_path / "dst", trust_remote_code=True)
    assert tok("abc").input_ids == [3, 4, 5]


@pytest.mark.parametrize("quantization", ["fp8_block_scales", "fp8_weights", "gptq"])
def test_quantized_checkpoint_is_refused_with_what_to_do(tmp_path, quantization):
    """FP8 weights (with or without their `weight_scale_inv` block scales) and GPTQ's packed integers are refused,
    naming a tensor, rather than failing on unexpected keys or being written out as they are."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    _hf_model("hybrid").save_pretrained(src)
    state = load_file(src / "model.safetensors")
    key = next(k for k in state if k.endswith("self_attn.q_proj.weight"))
    if quantization == "gptq":
        state[key.replace(".weight", ".qweight")] = state.pop(key).to(torch.int32)
    else:
        state[key] = state[key].to(torch.float8_e4m3fn)
        if quantization == "fp8_block_scales":
            state[key + "_scale_inv"] = torch.ones(1, 1)
    save_file(state, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"holds quantized tensors \(e\.g\. model\.layers\.\d+\.self_attn\.q_"
                                              r".*Dequantize the checkpoint to bf16 first"):
        convert_kimi_linear(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_weights_of_other_shapes_than_the_config_says_are_refused(tmp_path):
    """A config.json that does not describe the weights beside it (here: another `moe_intermediate_size`) is named at
    conversion, not written into a checkpoint that `from_pretrained` then cannot load."""
    src = tmp_path / "src"
    _hf_model("hybrid").save_pretrained(src)
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": 16}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.w1 is \(6, 24, 48\) in the checkpoint "
                                              r"but \(6, 16, 48\) in the model its config\.json describes"):
        convert_kimi_linear(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pickle_checkpoint_is_refused_with_how_to_resave_it(tmp_path):
    """A `pytorch_model.bin` checkpoint is never unpickled: the error names it and says how to get safetensors."""
    from kimi_vl.convert import convert_kimi_k25_vision

    model = _hf_model("hybrid")
    model.config.save_pretrained(tmp_path / "src")
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"No \*\.safetensors files .* It holds PyTorch pickle weights "
                                              r"\(pytorch_model\.bin\).*save_pretrained\(new_dir\)"):
        convert_kimi_linear(tmp_path / "src", tmp_path / "out")
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "kimi_k25_vision"}))
    with pytest.raises(CheckpointError, match=r"pickle weights \(pytorch_model\.bin\)"):
        convert_kimi_k25_vision(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_stale_shards_beside_the_index_are_not_read(tmp_path):
    """A new revision downloaded into the folder of an earlier one (more shards) leaves the old shards there: the
    files `model.safetensors.index.json` names are read, as transformers reads them, never a mix of both revisions."""
    import shutil

    from transformers import KimiLinearForCausalLM

    _hf_model("hybrid", seed=0).save_pretrained(tmp_path / "old", max_shard_size="60KB")
    _hf_model("hybrid", seed=1).save_pretrained(tmp_path / "src", max_shard_size="100KB")
    stale = [f for f in (tmp_path / "old").glob("model-*.safetensors") if not (tmp_path / "src" / f.name).exists()]
    assert stale
    for f in stale:
        shutil.copy(f, tmp_path / "src" / f.name)
    convert_kimi_linear(tmp_path / "src", tmp_path / "ours")
    ids, mask = _padded_batch()
    with torch.no_grad():
        ref = KimiLinearForCausalLM.from_pretrained(tmp_path / "src").eval()(ids, attention_mask=mask).logits
        got = KimiTextForCausalLM.from_pretrained(tmp_path / "ours").eval()(ids, attention_mask=mask).logits
    assert (got[mask.bool()] - ref[mask.bool()]).abs().max() < 1e-4
