"""Starts `test_kda_triton.py`'s child run in the Triton interpreter as soon as the session's tests are selected, so
that its minutes of single-threaded interpretation overlap the tests that run before that module."""

from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return
    mine = [it for it in items if Path(str(it.path)).name == "test_kda_triton.py"]
    if mine:
        mine[0].module.start_child(items, config)
