"""The embedded corpus: standard library sources and the tokenizer's training texts."""

import sysconfig
from pathlib import Path

import pytest

from kimi_vl.data.corpus import stdlib_documents, stdlib_paths, tokenizer_texts
from kimi_vl.errors import ConfigError
from kimi_vl.tokenization.special_tokens import SPECIAL_TOKENS


def test_stdlib_paths_sorted_and_filtered():
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = stdlib_paths()
    assert len(paths) > 200
    rel = [p.relative_to(root).as_posix() for p in paths]
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    for r in rel:
        parts = set(r.split("/")[:-1])
        assert not parts & {"test", "tests", "idlelib", "tkinter", "site-packages"}, r
    assert "os.py" in rel and "json/__init__.py" in rel


def test_stdlib_documents_cap_and_determinism():
    docs = stdlib_documents(max_chars=300_000)
    assert sum(map(len, docs)) == 300_000
    assert docs == stdlib_documents(max_chars=300_000)
    longer = stdlib_documents(max_chars=600_000)
    assert longer[: len(docs) - 1] == docs[:-1]  # a larger cap extends the list; only the last one was cut
    assert longer[len(docs) - 1].startswith(docs[-1])
    first = stdlib_paths()[0].read_text(encoding="utf-8")
    assert docs[0] == first[:300_000]
    assert stdlib_documents(0) == []
    with pytest.raises(ConfigError, match="max_chars"):
        stdlib_documents(-1)


def test_tokenizer_texts():
    texts = list(tokenizer_texts(0, 80))
    assert len(texts) == 80 and all(isinstance(t, str) and t for t in texts)
    assert texts == list(tokenizer_texts(0, 80))
    assert texts != list(tokenizer_texts(1, 80))
    joined = "\n".join(texts)
    assert "def " in joined or "class " in joined  # standard library code
    assert "Options:\nA. " in joined and "The answer is (" in joined  # MMLU-Pro format
    assert "<html><body" in joined  # screencast pages
    assert "How many" in joined  # vision questions
    assert not any(tok in joined for tok in SPECIAL_TOKENS)
    with pytest.raises(ConfigError):
        list(tokenizer_texts(0, -1))
