"""The README's examples run as printed (a tiny model stands in for a trained one; the slow quickstart test runs the
notebook example on the quickstart's own model)."""

import os
import re
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import numpy as np
from PIL import Image

from tests.test_export import tiny_model, tiny_processor
from tests.test_processing import write_video

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(marker: str) -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if marker in b]
    return block


def test_processor_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save("photo.jpg")
    write_video(tmp_path / "clip.mp4", 8, 4)
    scope = {"texts": ["the cat sat on the mat. What happens here?"] * 50,
             "other_messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}

    class Model:  # built on first use, from the processor the example has made by then
        def __getattr__(self, name):
            return getattr(tiny_model(scope["processor"]), name)

    scope["model"] = Model()
    exec(python_block("build_tokenizer(texts"), scope)
    inputs = scope["inputs"]
    assert inputs["input_ids"].shape[0] == 2 and (inputs["attention_mask"][:, 0] == 0).any()  # padded at the start
    assert inputs["pixel_values"].shape[1:] == (3, 14, 14) and "pixel_values_videos" in inputs


def test_vision_example_processors(tmp_path, monkeypatch):
    """The vision example's processor lines run as printed (the model lines need the user's own configs)."""
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save("photo.jpg")
    write_video(tmp_path / "clip.mp4", 8, 4)  # 2 s: 4 frames at 2 fps
    block = python_block("load_video(")
    scope = {}
    exec(block[: block.index("config = ")], scope)
    assert scope["images"].image_grid_thw.tolist() == [[1, 4, 6]]
    assert scope["images"].pixel_values.shape == (24, 3, 14, 14)
    assert scope["video"].video_grid_thw.tolist() == [[4, 4, 6]]


def notebook_reply(root: Path) -> str:
    """What the README's notebook example prints, run in `root` (whose `runs/quickstart/model` it loads)."""
    cwd, printed = Path.cwd(), StringIO()
    try:
        os.chdir(root)
        with redirect_stdout(printed):
            exec(python_block('from_pretrained("runs/quickstart/model")'), {})
    finally:
        os.chdir(cwd)
    return printed.getvalue()


def test_notebook_example(tmp_path):
    proc = tiny_processor()
    model_dir = tmp_path / "runs" / "quickstart" / "model"
    tiny_model(proc).save_pretrained(model_dir)
    proc.save_pretrained(model_dir)
    reply = notebook_reply(tmp_path)
    assert reply.endswith("\n") and reply.count("\n") == 1  # one reply, decoded without its special tokens
    assert "<|" not in reply


def test_text_backbone_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(python_block("vocab_size=32000, hidden_size=256"), scope)
    assert scope["out"].shape[0] == 2 and 100 < scope["out"].shape[1] <= 120 and scope["loss"].item() > 0
    assert (tmp_path / "my-model" / "config.json").is_file()
