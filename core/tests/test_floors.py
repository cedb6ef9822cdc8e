"""The core's floors (docs/design.md): no import runs back up a floor, and no modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import minisgl

ROOT = Path(minisgl.__file__).parent

# Floor of each top-level module or package: a module may import only from its own floor or lower ones.
FLOORS = {
    "__main__": 9, "cli": 9, "testing": 9, "scaffold": 9,
    "server": 8, "llm": 8,
    "tokenizer": 7,
    "scheduler": 6,
    "engine": 5,
    "attention": 4, "models": 4, "moe": 4,
    "layers": 3,
    "kvcache": 2,
    "kernel": 1,
    "distributed": 0, "core": 0, "config": 0, "message": 0, "plugins": 0, "utils": 0, "__init__": 10,
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return ".".join(parts)


def _exists(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _runtime_imports(path: Path) -> set[str]:
    """Modules of minisgl that ``path`` imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".") if path.name != "__init__.py" or path.parent != ROOT else []
    package = here if path.name == "__init__.py" else here[:-1]
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "minisgl":
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # "from . import hookspecs" names a module
                sub = ".".join([*target, alias.name])
                found.add(sub if _exists(sub) else ".".join(target) or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name[8:] for a in node.names if a.name.startswith("minisgl.")}
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _runtime_imports(p) for p in ROOT.rglob("*.py")}


def test_no_import_runs_back_up_a_floor() -> None:
    upward = [
        f"{mod} -> {dep}"
        for mod, deps in _graph().items()
        for dep in deps
        if FLOORS[dep.split(".")[0]] > FLOORS[mod.split(".")[0]]
    ]
    assert upward == []


def test_every_top_level_module_has_a_floor() -> None:
    assert {m.split(".")[0] for m in _graph()} <= set(FLOORS)


def test_no_import_circles() -> None:
    graph = _graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if dep == mod or dep.startswith(mod + "."):  # a package importing its own submodules
                continue
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep) :], dep] if dep in path else [mod, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    # A submodule importing its package's __init__ (re-exports) is not a circle of files.
    real = [c for c in circles if not any(b == a.rsplit(".", 1)[0] for a, b in zip(c, c[1:], strict=False))]
    assert real == []
