"""The README's processor example runs as printed (a tiny model stands in for a trained one)."""

import re
from pathlib import Path

import numpy as np
from PIL import Image

from tests.test_export import tiny_model
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
