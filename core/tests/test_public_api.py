"""The public plugin API (docs/plugins.md, "What a plugin may import"): the shipped plugins use nothing else."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Modules a plugin may import from, each with the names it may use (``None``: the module's ``__all__``).
PUBLIC: dict[str, set[str] | None] = {
    "minisgl": {"LLM", "RequestOutput", "SamplingParams"},
    "minisgl.plugins": None,
    "minisgl.attention": None,
    "minisgl.kvcache": None,
    "minisgl.layers": None,
    "minisgl.models": None,
    "minisgl.moe": None,
    "minisgl.distributed": None,
    "minisgl.kernel": {"KernelSet", "QKNorm", "fp32_reciprocal", "quantize_kv", "rms_norm", "select_kernels"},
    "minisgl.core": {"Batch", "Req", "SamplingParams", "TokenLogprob", "ValidationError"},
    "minisgl.engine.grammar": {"BaseGrammarBackend", "TokenMask", "error_field"},
}


def public_names(module: str) -> set[str]:
    declared = PUBLIC[module]
    if declared is not None:
        return declared
    mod = importlib.import_module(module)
    return set(getattr(mod, "__all__", None) or (n for n in vars(mod) if not n.startswith("_")))


def _imports(path: Path) -> list[tuple[str, str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "minisgl" or node.module.startswith("minisgl."):
                found += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("minisgl.")]
    return found


def test_every_public_name_exists() -> None:
    for module in PUBLIC:
        mod = importlib.import_module(module)
        missing = sorted(n for n in public_names(module) if not hasattr(mod, n))
        assert missing == [], f"{module} lacks {missing}"


PLUGIN_SOURCES = sorted((REPO / "plugins").glob("minisgl-plugin-*/src/**/*.py")) + sorted(
    (REPO / "docs" / "examples").glob("*/src/**/*.py")
)


@pytest.mark.skipif(not PLUGIN_SOURCES, reason="run from a source checkout (plugins/ not found)")
def test_shipped_plugins_import_only_the_public_api() -> None:
    outside = []
    for path in PLUGIN_SOURCES:
        for module, name, line in _imports(path):
            if module not in PUBLIC or (name and name not in public_names(module)):
                outside.append(f"{path.relative_to(REPO)}:{line}: {module}.{name}".rstrip("."))
    assert outside == []


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from minisgl.engine.engine import Engine\nfrom minisgl.attention import _private\n")
    found = [(m, n) for m, n, _ in _imports(bad) if m not in PUBLIC or n not in public_names(m)]
    assert found == [("minisgl.engine.engine", "Engine"), ("minisgl.attention", "_private")]
