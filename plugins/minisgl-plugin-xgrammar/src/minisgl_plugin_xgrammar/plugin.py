"""Entry module: declares the ``xgrammar`` grammar backend; xgrammar is imported only when it is built."""

from __future__ import annotations

from minisgl.plugins import GrammarBackendSpec, hookimpl


@hookimpl
def minisgl_grammar_backends() -> list[GrammarBackendSpec]:
    return [
        GrammarBackendSpec(
            name="xgrammar",
            factory="minisgl_plugin_xgrammar.backend:XGrammarBackend",
            description="JSON, JSON schema, regex and EBNF grammars compiled and matched by xgrammar (CPU and CUDA)",
        )
    ]
