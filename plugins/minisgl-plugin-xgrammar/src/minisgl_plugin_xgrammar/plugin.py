"""Entry module: declares the ``xgrammar`` grammar backend; xgrammar is imported only when it is built."""

from __future__ import annotations

import importlib.util

from minisgl.plugins import GrammarBackendSpec, Unsupported, hookimpl


def is_supported(device: str) -> bool:
    """Wherever the ``xgrammar`` library can be found (without importing it)."""
    if importlib.util.find_spec("xgrammar") is None:
        raise Unsupported("the xgrammar library is not installed; pip install 'xgrammar>=0.2.9'")
    return True


@hookimpl
def minisgl_grammar_backends() -> list[GrammarBackendSpec]:
    return [
        GrammarBackendSpec(
            name="xgrammar",
            auto=True,
            factory="minisgl_plugin_xgrammar.backend:XGrammarBackend",
            is_supported=is_supported,
            description="JSON, JSON schema, regex and EBNF grammars compiled and matched by xgrammar (CPU and CUDA)",
        )
    ]
