"""Shared fixtures of the evaluation tests: the real benchmark samples (../shared/data) and local data dirs."""

import json
from pathlib import Path

import pytest

_CANDIDATES = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data", Path("/work/shared/data"))


def shared_data_dir() -> Path | None:
    for c in _CANDIDATES:
        if (c / "mmlu_pro").is_dir() and (c / "mathvista").is_dir():
            return c.resolve()
    return None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    found = shared_data_dir()
    if found is None:
        pytest.skip("the real benchmark samples (../shared/data/mmlu_pro, ../shared/data/mathvista) are not here")
    return found


@pytest.fixture(scope="session")
def mmlu_fixture_rows(shared_data) -> list[dict]:
    path = shared_data / "mmlu_pro" / "llama2_7b_5shot_outputs_sample.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def mathvista_outputs(shared_data) -> dict:
    return json.loads((shared_data / "mathvista" / "output_llava_llama_2_13b.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def mathvista_testmini(shared_data) -> dict:
    return json.loads((shared_data / "mathvista" / "testmini.json").read_text(encoding="utf-8"))
