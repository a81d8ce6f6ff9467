"""Shared fixtures of the data tests: a tiny processor whose tokenizer is trained on `tokenizer_texts`."""

from pathlib import Path

import pytest

from kimi_vl.data.corpus import tokenizer_texts
from kimi_vl.fusion import build_tokenizer
from kimi_vl.processing import KimiVLProcessor
from kimi_vl.vision import MoonViTImageProcessor, MoonViTVideoProcessor

_SHARED = (Path(__file__).resolve().parents[3] / ".." / "shared" / "data", Path("/work/shared/data"))


@pytest.fixture(scope="session")
def proc() -> KimiVLProcessor:
    """Image budget 256 patches, video 64 patches per frame (the `tiny` preset's), vocab ~1000."""
    tok = build_tokenizer(tokenizer_texts(0, 400), 1000)
    return KimiVLProcessor(MoonViTImageProcessor(max_patches=256), tok, MoonViTVideoProcessor(fps=2, max_patches=64))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    for c in _SHARED:
        if (c / "mmlu_pro").is_dir() and (c / "mathvista").is_dir():
            return c.resolve()
    pytest.skip("the real benchmark samples (../shared/data) are not here")
