"""`kimi-vl quickstart` with a reduced step count: every artefact exists and loads, and a rerun resumes."""

import json
import re

import pytest
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import kimi_vl  # noqa: F401
from kimi_vl.cli import main


@pytest.mark.slow
def test_quickstart_smoke(tmp_path):
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--scale", "0.02", "--eval-limit", "4"]) == 0
    report = (out / "REPORT.md").read_text()
    for heading in ("## Training", "## Evaluation (synthetic proxies", "## Video to website", "## Wall time"):
        assert heading in report
    model = AutoModelForImageTextToText.from_pretrained(out / "model")
    processor = AutoProcessor.from_pretrained(out / "model")
    assert type(model).__name__ == "KimiVLForConditionalGeneration" and type(processor).__name__ == "KimiVLProcessor"
    images = [re.search(r"\]\((.+)\)$", line).group(1) for line in report.splitlines() if line.startswith("![")]
    assert len(images) >= 5
    for rel in images:
        with Image.open(out / rel) as im:
            assert im.format == "PNG" and im.width > 50
    evals = json.loads((out / "eval" / "done.json").read_text())
    assert set(evals["sft"]) == {"mmlu_pro_synth", "mathvista_synth"} and evals["chance"]["mmlu_pro_synth"] == 0.1
    assert (out / "demo" / "site.html").read_text().startswith("<!DOCTYPE html>")
    before = (out / "model" / "model.safetensors").stat().st_mtime
    assert main(["quickstart", "--out", str(out), "--scale", "0.02", "--eval-limit", "4"]) == 0  # all stages done
    assert (out / "model" / "model.safetensors").stat().st_mtime >= before
    assert json.loads((out / "stage_times.json").read_text()).keys() >= {"pretrain", "sft", "rl", "eval", "demo"}
