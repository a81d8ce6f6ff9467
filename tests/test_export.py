"""Publishing: remote-code export (`kimi_vl.export`, `kimi-vl export`, `add_remote_code` in place) loading where
`kimi_vl` cannot be imported, and the save / load round trip of model + processor in a fresh process."""

import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from kimi_vl.cli import main
from kimi_vl.configuration import KimiVLConfig
from kimi_vl.errors import CheckpointError, KimiVLError
from kimi_vl.export import (
    ENTRY_MODULE,
    TRAINING_RECORDS,
    add_remote_code,
    export_remote_code,
    generate_modules,
    rewrite_imports,
)
from kimi_vl.modeling import KimiVLForConditionalGeneration
from kimi_vl.processing import KimiVLProcessor
from kimi_vl.text import KimiTextConfig
from kimi_vl.tokenization import build_tokenizer
from kimi_vl.vision import MoonViTConfig, MoonViTImageProcessor, MoonViTVideoProcessor

WORDS = "the a cat dog sees red blue green square circle how many is what describe video image".split()


# --- a tiny saved checkpoint (model + processor + tokenizer) ------------------------------------------------------------
def tiny_processor() -> KimiVLProcessor:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) + "." for _ in range(100)]
    tok = build_tokenizer(texts, 320)
    return KimiVLProcessor(MoonViTImageProcessor(max_patches=64), tok, MoonViTVideoProcessor(fps=4, max_patches=32))


def tiny_model(proc: KimiVLProcessor, seed: int = 0) -> KimiVLForConditionalGeneration:
    torch.manual_seed(seed)
    tok = proc.tokenizer
    text = KimiTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_experts=4,
        num_experts_per_tok=2, kda_head_dim=8, kda_num_heads=2, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    vision = MoonViTConfig(hidden_size=24, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
                           pos_emb_height=8, pos_emb_width=8)
    config = KimiVLConfig(vision_config=vision, text_config=text, image_token_id=proc.image_token_id,
                          video_token_id=proc.video_token_id)
    model = KimiVLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "conv" not in name:
                p.normal_(0, 0.2)
    return model


def write_media(root: Path) -> tuple[Path, Path]:
    """A small png and a 6-frame mp4."""
    png = root / "pic.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(png)
    mp4 = root / "clip.mp4"
    with av.open(str(mp4), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(6):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 + 30 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return png, mp4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    proc = tiny_processor()
    model = tiny_model(proc)
    model.save_pretrained(root / "model")
    proc.save_pretrained(root / "model")
    png, mp4 = write_media(root)
    return {"dir": root / "model", "model": model, "proc": proc, "png": png, "mp4": mp4}


# The same inputs and outputs in this process and in the subprocesses.
INPUTS = """
messages = [{"role": "user", "content": [
    {"type": "image", "path": PNG}, {"type": "video", "path": MP4}, {"type": "text", "text": "what is the cat"}]}]
inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                  return_tensors="pt", processor_kwargs={"num_frames": 4})
with torch.no_grad():
    logits = model(**inputs).logits
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
outputs = {**{k: v.contiguous() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
           "logits": logits.contiguous(), "generated": generated.contiguous()}
"""


def reference_outputs(checkpoint) -> dict[str, torch.Tensor]:
    scope = {"torch": torch, "proc": checkpoint["proc"], "model": checkpoint["model"], "PNG": str(checkpoint["png"]),
             "MP4": str(checkpoint["mp4"])}
    exec(INPUTS, scope)
    return scope["outputs"]


def run_script(body: str, tmp_path: Path, block_kimi_vl: bool, **paths) -> dict[str, torch.Tensor]:
    """Run `body` (which sets `model`, `proc`) + INPUTS in a fresh interpreter; return its `outputs`."""
    header = "import sys\n"
    if block_kimi_vl:
        header += textwrap.dedent("""
            sys.modules["kimi_vl"] = None  # the package is installed (editable): make it unimportable
            try:
                import kimi_vl  # noqa: F401
            except ImportError:
                pass
            else:
                raise SystemExit("kimi_vl is importable")
        """)
    header += "import torch\nfrom safetensors.torch import save_file\n"
    header += "".join(f"{k} = {str(v)!r}\n" for k, v in paths.items())
    footer = textwrap.dedent("""
        save_file(outputs, OUT)
        leaked = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] == "kimi_vl")
        print("KIMI_VL_MODULES", leaked)
    """)
    out = tmp_path / "outputs.safetensors"
    script = tmp_path / "script.py"
    script.write_text(header + f"OUT = {str(out)!r}\n" + textwrap.dedent(body) + INPUTS + footer)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    if block_kimi_vl:
        assert "KIMI_VL_MODULES []" in result.stdout
    return load_file(out)


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for key in ref:
        if key == "logits":
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=0)
        else:
            assert torch.equal(got[key], ref[key]), key


# --- export ------------------------------------------------------------------------------------------------------------
def test_export_loads_without_kimi_vl(checkpoint, tmp_path):
    out = export_remote_code(checkpoint["dir"], tmp_path / "remote")
    assert out == tmp_path / "remote"
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"] == f"{ENTRY_MODULE}.KimiVLConfig"
    assert config["auto_map"]["AutoModelForImageTextToText"] == f"{ENTRY_MODULE}.KimiVLForConditionalGeneration"
    processor_config = json.loads((out / "processor_config.json").read_text())
    assert processor_config["auto_map"] == {"AutoProcessor": f"{ENTRY_MODULE}.KimiVLProcessor"}
    assert processor_config["image_processor"]["auto_map"] == {
        "AutoImageProcessor": f"{ENTRY_MODULE}.MoonViTImageProcessor"
    }
    assert processor_config["video_processor"]["auto_map"] == {
        "AutoVideoProcessor": f"{ENTRY_MODULE}.MoonViTVideoProcessor"
    }

    body = """
    from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline
    model = AutoModelForImageTextToText.from_pretrained(REMOTE, trust_remote_code=True).eval()
    proc = AutoProcessor.from_pretrained(REMOTE, trust_remote_code=True)
    # one package, one copy of each class
    assert type(model.config) is model.config_class, (type(model.config), model.config_class)
    assert type(model).__module__ == type(proc).__module__ == type(proc.image_processor).__module__
    assert type(model).__module__.startswith("transformers_modules.") and type(model).__module__.endswith(".modeling_kimi_vl")
    assert type(proc.video_processor).__name__ == "MoonViTVideoProcessor"
    # re-saving a loaded remote-code model + processor gives a directory that loads again
    model.save_pretrained(RESAVED)
    proc.save_pretrained(RESAVED)
    again = AutoModelForImageTextToText.from_pretrained(RESAVED, trust_remote_code=True).eval()
    again_proc = AutoProcessor.from_pretrained(RESAVED, trust_remote_code=True)
    assert type(again.config) is again.config_class
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert again_proc.chat_template == proc.chat_template
    # the image-text-to-text pipeline on the exported directory
    pipe = pipeline("image-text-to-text", model=REMOTE, trust_remote_code=True)
    answer = pipe(text=[{"role": "user", "content": [{"type": "image", "path": PNG}, {"type": "text", "text": "cat"}]}],
                  max_new_tokens=3, generate_kwargs={"do_sample": False})
    assert isinstance(answer[0]["generated_text"][-1]["content"], str)
    """
    got = run_script(body, tmp_path, block_kimi_vl=True, REMOTE=out, RESAVED=tmp_path / "resaved",
                     PNG=checkpoint["png"], MP4=checkpoint["mp4"])
    ref = reference_outputs(checkpoint)
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"} <= ref.keys()
    assert_same(got, ref)


def test_add_remote_code_makes_a_saved_folder_self_contained_in_place(checkpoint, tmp_path):
    model_dir = shutil.copytree(checkpoint["dir"], tmp_path / "model")  # as save_pretrained left it
    saved = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    assert add_remote_code(model_dir) == model_dir
    once = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    assert once["model.safetensors"] == saved["model.safetensors"] and f"{ENTRY_MODULE}.py" in once
    assert json.loads(once["config.json"])["auto_map"]["AutoModelForImageTextToText"].startswith(ENTRY_MODULE)
    add_remote_code(model_dir)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == once  # idempotent
    # that such a folder loads where kimi_vl cannot be imported, with the same outputs, is tested on a stage's folder
    # (`test_stages.py::test_stage_outputs_load_without_kimi_vl`): every training stage ends with `add_remote_code`


def test_generated_modules_are_flat():
    files = generate_modules()
    assert f"{ENTRY_MODULE}.py" in files and "kimi_vl_modeling.py" in files and "kimi_vl_text_kda.py" in files
    for name, text in files.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "kimi_vl" for a in node.names), name
            elif isinstance(node, ast.ImportFrom):
                assert node.level <= 1, (name, node.lineno)
                assert node.level == 1 or (node.module or "").split(".")[0] != "kimi_vl", (name, node.lineno)
                if node.level == 1:
                    assert f"{node.module}.py" in files, (name, node.module)
    # the source modules are copied verbatim apart from the import lines
    source = Path(sys.modules["kimi_vl.text.kda"].__file__).read_text().splitlines()
    flat = files["kimi_vl_text_kda.py"].splitlines()[1:]
    assert len(flat) == len(source)
    changed = [(a, b) for a, b in zip(source, flat) if a != b]
    assert changed and all(a.lstrip().startswith("from ") and b.lstrip().startswith("from .kimi_vl_") for a, b in changed)


def test_rewrite_imports_forms():
    source = textwrap.dedent("""\
        from __future__ import annotations
        import torch
        from ..errors import (
            ConfigError,
            ShapeError as SE,  # comment
        )
        from .cache import KimiHybridCache  # trailing comment
        from kimi_vl.kernels.kda import chunk_kda


        def f():
            from kimi_vl.kernels.kda_triton import chunk_kda_triton
            return chunk_kda_triton
        """)
    text, needed = rewrite_imports(source, "kimi_vl.text.kda", is_package=False)
    assert needed == ["kimi_vl.errors", "kimi_vl.kernels.kda", "kimi_vl.kernels.kda_triton", "kimi_vl.text.cache"]
    assert "from .kimi_vl_errors import ConfigError, ShapeError as SE\n" in text
    assert "from .kimi_vl_text_cache import KimiHybridCache  # trailing comment\n" in text
    assert "from .kimi_vl_kernels_kda import chunk_kda\n" in text
    assert "    from .kimi_vl_kernels_kda_triton import chunk_kda_triton\n" in text
    assert "import torch\n" in text and "from __future__ import annotations\n" in text
    # a package's __init__ resolves `.x` inside itself
    text, needed = rewrite_imports("from .cache import X\n", "kimi_vl.text", is_package=True)
    assert text == "from .kimi_vl_text_cache import X\n" and needed == ["kimi_vl.text.cache"]
    with pytest.raises(KimiVLError, match="cannot be flattened"):
        rewrite_imports("import kimi_vl.errors\n", "kimi_vl.modeling", is_package=False)
    with pytest.raises(KimiVLError, match="submodule kimi_vl.text.kda"):
        rewrite_imports("from .text import kda\n", "kimi_vl.modeling", is_package=False)
    with pytest.raises(KimiVLError, match="stand alone"):
        rewrite_imports("import os; from .errors import X\n", "kimi_vl.modeling", is_package=False)


def test_export_rejects_other_directories(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        export_remote_code(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_vl_text"}))
    with pytest.raises(CheckpointError, match="'kimi_vl_text' config"):
        export_remote_code(tmp_path, tmp_path / "out")
    for text in ("{oops", "[1, 2]"):  # unparsable, or not an object
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match="config.json"):
            export_remote_code(tmp_path, tmp_path / "out")


def test_cli_export(checkpoint, tmp_path, capsys):
    assert main(["export", str(checkpoint["dir"]), str(tmp_path / "remote")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "remote" / f"{ENTRY_MODULE}.py").is_file()
    assert (tmp_path / "remote" / "model.safetensors").is_file()
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_export_leaves_out_training_records_and_never_mixes_checkpoints(checkpoint, tmp_path, capsys):
    stage = tmp_path / "stage"  # a training stage's folder: the checkpoint and its run's records
    shutil.copytree(checkpoint["dir"], stage)
    for name in ("state/step_00000010", "plots"):
        (stage / name).mkdir(parents=True)
    (stage / "state" / "step_00000010" / "optimizer.pt").write_bytes(b"x")
    (stage / "metrics.jsonl").write_text("{}\n")
    (stage / "README.md").write_text("model card")
    out = export_remote_code(stage, tmp_path / "published")
    names = {p.name for p in out.iterdir()}
    assert not names & TRAINING_RECORDS and {"README.md", "model.safetensors", f"{ENTRY_MODULE}.py"} <= names
    assert (out / "README.md").read_text() == "model card"  # the checkpoint's own card stays

    stale = out / "model.safetensors.index.json"  # another checkpoint's shard index would shadow the weights
    stale.write_text("{}")
    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="not empty"):
        export_remote_code(stage, out)
    assert stale.is_file() and not list(tmp_path.glob(".published*"))  # refused before anything was written
    assert main(["export", str(stage), str(out)]) == 2 and "--overwrite" in capsys.readouterr().err
    assert main(["export", str(stage), str(out), "--overwrite"]) == 0
    assert not stale.exists() and (out / "model.safetensors").read_bytes() == weights
    with pytest.raises(CheckpointError, match="inside the checkpoint"):
        export_remote_code(stage, stage / "published")
    assert export_remote_code(stage, stage) == stage and (stage / "state").is_dir()  # in place: nothing removed
    (tmp_path / "precious.txt").write_text("x")  # exporting over the folder that holds the checkpoint
    assert main(["export", str(stage), str(tmp_path), "--overwrite"]) == 2
    assert "would delete the source" in capsys.readouterr().err
    assert (stage / "state" / "step_00000010" / "optimizer.pt").is_file() and (tmp_path / "precious.txt").is_file()


def test_export_writes_a_model_card_whose_code_runs(checkpoint, tmp_path, capsys):
    """Without a card of its own, the published copy gets one: the Hub's metadata, the architecture with the weights
    counted from the files, the training stage's summary (no local paths), and code that loads and prompts it."""
    stage = tmp_path / "stage"
    shutil.copytree(checkpoint["dir"], stage)
    (stage / "training_summary.json").write_text(json.dumps(
        {"stage": "sft", "preset": "tiny", "from": "/home/me/runs/pre", "steps": 5, "final_loss": 1.23456}))
    out = export_remote_code(stage, tmp_path / "kimi-vl-tiny")
    card = (out / "README.md").read_text()
    head = card.split("---")[1]
    assert "library_name: transformers" in head and "pipeline_tag: image-text-to-text" in head
    model = checkpoint["model"]
    weights = sum(t.numel() for t in model.state_dict().values())
    assert card.splitlines()[card.splitlines().index("# kimi-vl-tiny") + 2].startswith(
        f"A Kimi-style early-fusion vision-language model of {weights:,} weights")
    assert "3 KDA + 1 MLA (NoPE)" in card and "| steps | 5 |" in card and "| final_loss | 1.235 |" in card
    assert "/home/me" not in card
    (code,) = re.findall(r"```python\n(.*?)```", card, re.S)
    shutil.copy(checkpoint["png"], tmp_path / "photo.jpg")
    code = code.replace('"ORG/NAME"', repr(str(out))).replace('"photo.jpg"', repr(str(tmp_path / "photo.jpg")))
    exec(code, {})
    assert capsys.readouterr().out.count("\n") == 1  # the reply



def test_model_card_of_a_rope_mla_model_does_not_call_it_kimi_linear(tmp_path):
    """A converted Kimi K2.5 (every layer RoPE-MLA, no KDA) is a DeepSeek-V3-style backbone, not a Kimi-Linear one."""
    from kimi_vl.model_card import model_card

    proc = tiny_processor()
    text = KimiTextConfig(vocab_size=len(proc.tokenizer), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=2, layer_types=["mla_rope"] * 2, num_attention_heads=2, kv_lora_rank=12,
                          qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_tok=2)
    vision = MoonViTConfig(hidden_size=24, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
                           pos_emb_height=8, pos_emb_width=8)
    KimiVLForConditionalGeneration(KimiVLConfig(vision_config=vision, text_config=text, image_token_id=proc.image_token_id,
                                                video_token_id=proc.video_token_id)).save_pretrained(tmp_path)
    card = model_card(tmp_path)
    assert "feeding one DeepSeek-V3-style (Kimi K2) backbone (2 layers: 2 RoPE-MLA;" in card
    assert "Kimi-Linear" not in card and "kimi-linear" not in card.split("---")[1]


# --- save / load round trip --------------------------------------------------------------------------------------------
def test_save_load_round_trip_in_fresh_process(checkpoint, tmp_path):
    body = """
    import kimi_vl  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForImageTextToText, AutoProcessor
    model = AutoModelForImageTextToText.from_pretrained(CKPT).eval()
    proc = AutoProcessor.from_pretrained(CKPT)
    assert type(model).__name__ == "KimiVLForConditionalGeneration" and type(model).__module__ == "kimi_vl.modeling"
    assert type(proc).__module__ == "kimi_vl.processing"
    """
    got = run_script(body, tmp_path, block_kimi_vl=False, CKPT=checkpoint["dir"], PNG=checkpoint["png"],
                     MP4=checkpoint["mp4"])
    assert_same(got, reference_outputs(checkpoint))
