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


def test_report_shows_every_evaluated_stage_against_chance(tmp_path):
    """REPORT.md's evaluation table has one column per evaluated checkpoint (pre-training, SFT, RL), chance, and
    says how accuracy was measured; an older eval/done.json without the pre-training entry still renders."""
    from kimi_vl.eval.proxies import PROXY_EVAL_CONFIG
    from kimi_vl.quickstart import EVAL_STAGES, write_report

    (tmp_path / "eval").mkdir()
    entry = lambda c: {"proxy": True, "accuracy": c / 100, "correct": c, "total": 100}  # noqa: E731
    done = {name: {"mmlu_pro_synth": entry(10 + i), "mathvista_synth": entry(20 + i)}
            for i, name in enumerate(EVAL_STAGES)}
    done.update(chance={"mmlu_pro_synth": 0.1, "mathvista_synth": 0.0468}, settings=PROXY_EVAL_CONFIG.changes())
    (tmp_path / "eval" / "done.json").write_text(json.dumps(done))
    report = write_report(tmp_path, {"pretrain": 1.0}).read_text()
    assert "| benchmark | chance | after pre-training | after SFT | after RL |" in report
    assert "| mmlu_pro_synth | 10.0% | 10.0% (10/100) | 11.0% (11/100) | 12.0% (12/100) |" in report
    assert "| mathvista_synth | 4.7% | 20.0% (20/100) | 21.0% (21/100) | 22.0% (22/100) |" in report
    assert "official answer extraction" in report
    del done["pretrain"]
    (tmp_path / "eval" / "done.json").write_text(json.dumps(done))
    assert "| benchmark | chance | after SFT | after RL |" in write_report(tmp_path, {}).read_text()
