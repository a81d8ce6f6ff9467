"""Shared fixtures of the evaluation tests: rows of the real benchmark samples (`benchmark_samples`, tests/fixtures)."""

import json

import pytest


@pytest.fixture(scope="session")
def mmlu_fixture_rows(benchmark_samples) -> list[dict]:
    path = benchmark_samples / "mmlu_pro" / "llama2_7b_5shot_outputs_sample.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def mathvista_outputs(benchmark_samples) -> dict:
    return json.loads((benchmark_samples / "mathvista" / "output_llava_llama_2_13b.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def mathvista_testmini(benchmark_samples) -> dict:
    return json.loads((benchmark_samples / "mathvista" / "testmini.json").read_text(encoding="utf-8"))
