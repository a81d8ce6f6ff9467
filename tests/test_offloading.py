"""`from_pretrained` with a `device_map` that offloads weights is refused (it computed silently wrong logits)."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from kimi_vl.errors import ConfigError
from kimi_vl.offloading import offloaded_modules
from tests.test_modeling import tiny_vl
from tests.text.test_model import tiny_model


def test_offloaded_modules_follow_accelerates_rule():
    assert offloaded_modules({"a": "cpu", "b": "disk"}) == ["b"]  # no accelerator: the CPU runs "cpu" modules
    assert offloaded_modules({"a": 0, "b": "cpu", "c": "disk"}) == ["b", "c"]  # with one, "cpu" means offloaded
    assert offloaded_modules({"a": 0, "b": "cuda:1"}) == offloaded_modules({"": "cpu"}) == offloaded_modules(None) == []


@pytest.mark.parametrize("which", ["text", "vl"])
def test_device_map_offloading_to_disk_is_refused(which, tmp_path):
    """Offloaded (here to disk), the text model's KDA layers read their conv filters from unloaded submodules: with a
    standard residual the logits came out wrong without an error; the AttnRes and vision models failed on meta
    tensors. A map that keeps the model on the CPU still loads, with the model's logits."""
    model = tiny_model(residual="standard") if which == "text" else tiny_vl()
    model.save_pretrained(tmp_path / "m")
    auto = AutoModelForCausalLM if which == "text" else AutoModelForImageTextToText
    with pytest.raises(ConfigError, match="offloads .*disk"):
        auto.from_pretrained(tmp_path / "m", device_map="auto", max_memory={"cpu": "60KB"},
                             offload_folder=str(tmp_path / "offload"))
    if which == "vl":
        model.vision_tower.save_pretrained(tmp_path / "vision")
        with pytest.raises(ConfigError, match="MoonViTModel"):
            AutoModel.from_pretrained(tmp_path / "vision", device_map={"patch_embed": "cpu", "rotary_emb": "cpu",
                                                                       "layers": "disk", "final_layernorm": "disk"},
                                      offload_folder=str(tmp_path / "offload_vision"))
        return
    ids = torch.arange(3, 23).reshape(2, 10)
    loaded = auto.from_pretrained(tmp_path / "m", device_map="auto").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
