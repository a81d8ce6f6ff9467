"""Starts `test_kda_triton.py`'s child run in the Triton interpreter, and `test_kda_triton_compile.py`'s compile
processes, as soon as the session's tests are selected, and moves those two modules' tests to the end of the
session, so that their single-threaded minutes overlap every other test instead of the main process waiting for them
(on the slow 2-core machine of docs/RESULTS.md the first interpreted test waited 103 s where it was collected)."""

from pathlib import Path

import pytest

INTERPRETED, COMPILED = "test_kda_triton.py", "test_kda_triton_compile.py"


def _module(item: pytest.Item) -> str:
    return Path(str(item.path)).name


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return
    mine = [it for it in items if _module(it) == INTERPRETED]
    if mine:
        mine[0].module.start_child(items, config)
    compiles = [it for it in items if _module(it) == COMPILED]
    if compiles:
        compiles[0].module.start_compiles(compiles, config)
    # a stable sort: every module keeps its order, the child-backed ones last
    items.sort(key=lambda it: _module(it) in (INTERPRETED, COMPILED))
