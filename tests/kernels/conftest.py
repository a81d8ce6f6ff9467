"""Starts `test_kda_triton.py`'s child run in the Triton interpreter, and `test_kda_triton_compile.py`'s compile
processes, as soon as the session's tests are selected, so that their single-threaded minutes overlap the tests that
run before those modules."""

from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return
    mine = [it for it in items if Path(str(it.path)).name == "test_kda_triton.py"]
    if mine:
        mine[0].module.start_child(items, config)
    compiles = [it for it in items if Path(str(it.path)).name == "test_kda_triton_compile.py"]
    if compiles:
        compiles[0].module.start_compiles(compiles, config)
