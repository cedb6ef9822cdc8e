"""How each grammar kind is compiled by xgrammar: shared by the backend and its compile process."""

from __future__ import annotations

from typing import Any

# Replies are compact JSON: no whitespace, not even xgrammar's default ", " and ": " separators.
COMPACT = {"any_whitespace": False, "separators": (",", ":")}
KIND_NAMES = {"json": "json", "json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}


def compile_grammar(compiler: Any, kind: str, text: str) -> Any:
    """``compiler`` (an ``xgrammar.GrammarCompiler``)'s compiled grammar of ``(kind, text)``; xgrammar's own
    exception for one it refuses."""
    if kind == "json":
        # Any JSON object, compact: free whitespace lets a small model pad forever.
        return compiler.compile_json_schema('{"type": "object"}', **COMPACT)
    if kind == "json_schema":
        return compiler.compile_json_schema(text, strict_mode=True, **COMPACT)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")
