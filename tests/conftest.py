"""Every test starts from the same global RNG state, so results do not depend on test order; `benchmark_samples` is
the folder of real benchmark files (`tests/fixtures/README.md` says where each comes from); data-file indexes are
cached in a temporary folder, never in the user's home."""

import os
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def benchmark_samples() -> Path:
    """`tests/fixtures`: `mmlu_pro/` and `mathvista/` official result samples, in the repository."""
    return FIXTURES


@pytest.fixture(autouse=True, scope="session")
def _index_cache(tmp_path_factory):
    os.environ["KIMI_VL_CACHE"] = str(tmp_path_factory.mktemp("kimi_vl_cache"))
