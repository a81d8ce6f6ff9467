"""The package's rooms and their dependency direction (DESIGN.md §1): no import circle between kimi_vl modules, and
no module imports a room above its own (imports inside functions, made when they run, are not counted)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kimi_vl"
LEVELS = {
    "errors": 0, "activation_checkpointing": 0, "options": 0, "optim_contract": 0, "edit_distance": 0, "progress": 0,
    "offloading": 0,
    "kernels": 1,
    "text": 2, "vision": 2, "tokenization": 2,
    "fusion": 3, "configuration": 3,
    "modeling": 4, "processing": 4, "convert": 4, "export": 4, "model_card": 4,
    "data": 5,
    "training": 6, "eval": 6, "demos": 6,
    "quickstart": 7, "cli": 7, "__init__": 7,
}
"""The rooms from the bottom up: a module may import its own level and the ones below."""


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """kimi_vl modules imported at module level (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kimi_vl"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kimi_vl"))
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the kimi_vl modules it imports at module level, its own parent packages left out (Python has them
    initialised, or initialising, before the module runs)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {t for t in _top_level_imports(p) if t in modules and t != m and not m.startswith(t + ".")}
            for m, p in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_rooms_import_downwards():
    graph = _graph()
    assert set(map(_room, graph)) <= set(LEVELS), sorted(set(map(_room, graph)) - set(LEVELS))
    bad = [(m, t) for m, targets in graph.items() for t in targets
           if _room(m) != _room(t) and LEVELS[_room(t)] > LEVELS[_room(m)]]
    assert not bad, bad
