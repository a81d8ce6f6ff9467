"""Shared fixtures of the data tests: a tiny processor whose tokenizer is trained on `tokenizer_texts`."""

import pytest

from kimi_vl.data.corpus import tokenizer_texts
from kimi_vl.processing import KimiVLProcessor
from kimi_vl.tokenization import build_tokenizer
from kimi_vl.vision import MoonViTImageProcessor, MoonViTVideoProcessor


@pytest.fixture(scope="session")
def proc() -> KimiVLProcessor:
    """Image budget 256 patches, video 64 patches per frame (the `tiny` preset's), vocab ~1000."""
    tok = build_tokenizer(tokenizer_texts(0, 400), 1000)
    return KimiVLProcessor(MoonViTImageProcessor(max_patches=256), tok, MoonViTVideoProcessor(fps=2, max_patches=64))

