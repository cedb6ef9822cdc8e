"""JSON-schema keywords: each one the backend lets through is enforced by xgrammar (a breaking value is rejected),
each one it refuses is one xgrammar would ignore, and replies are compact JSON. No model or tokenizer needed but
the word tokenizer of the refusal tests."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import xgrammar
from minisgl_plugin_xgrammar.backend import COMPACT, XGrammarBackend
from minisgl_plugin_xgrammar.schema import ENFORCED, FORMATS, schema_problem
from xgrammar.testing import _is_grammar_accept_string

from minisgl.core import ValidationError
from minisgl.testing.models import save_word_tokenizer


def accepts(schema: dict[str, Any], value: Any) -> bool:
    """Whether the grammar compiled from ``schema`` (as the backend compiles it) accepts ``value`` compactly."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **COMPACT)
    return bool(_is_grammar_accept_string(grammar, json.dumps(value, separators=(",", ":"))))


INT_LIST = {"type": "array", "items": {"type": "integer"}}
# keyword -> (a schema using it, a value that breaks it)
ENFORCED_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "type": ({"type": "integer"}, "x"),
    "enum": ({"enum": [1, 2]}, 3),
    "const": ({"const": 3}, 4),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),
    "minLength": ({"type": "string", "minLength": 3}, "a"),
    "maxLength": ({"type": "string", "maxLength": 3}, "abcd"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "b"),
    "format": ({"type": "string", "format": "email"}, "not an address"),
    "minimum": ({"type": "integer", "minimum": 3}, 1),
    "maximum": ({"type": "integer", "maximum": 3}, 5),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 3),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, 3),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 4),
    "minItems": ({**INT_LIST, "minItems": 2}, [1]),
    "maxItems": ({**INT_LIST, "maxItems": 1}, [1, 2]),
    "minProperties": ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, {}),
    "maxProperties": ({"type": "object", "additionalProperties": True, "maxProperties": 1}, {"a": 1, "b": 2}),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": "x"}),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}}, {"b": "x"}),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
        {"a": "x"},
    ),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": True}, {"b": 1}),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}, {"b": 1}),
    "items": (INT_LIST, ["x"]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, ["x"]),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{}], "unevaluatedItems": False}, [1, 2]),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, True),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 3}]}, 5),
    "$ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "s"),
    "$defs": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "s"),
    "definitions": ({"definitions": {"x": {"type": "integer"}}, "$ref": "#/definitions/x"}, "s"),
}
# keyword -> (a schema using it, a value that breaks it but that xgrammar accepts)
REFUSED_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "uniqueItems": ({**INT_LIST, "uniqueItems": True}, [1, 1]),
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 7}]}, 9),
    "contains": ({**INT_LIST, "contains": {"const": 5}}, [1]),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, 3),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, 9),
    "dependentRequired": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
    ),
    "dependentSchemas": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1},
    ),
    "format": ({"type": "string", "format": "idn-email"}, "not an address"),
    "$ref": ({"$ref": "https://example.com/schema.json"}, [1, "anything"]),
}  # fmt: skip


def test_every_enforced_keyword_is_tested() -> None:
    assert set(ENFORCED_CASES) == ENFORCED


@pytest.mark.parametrize("keyword", sorted(ENFORCED_CASES))
def test_an_enforced_keyword_rejects_a_breaking_value(keyword: str) -> None:
    schema, bad = ENFORCED_CASES[keyword]
    assert schema_problem(schema) is None
    assert not accepts(schema, bad)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_enforced_format_rejects_a_breaking_value(fmt: str) -> None:
    schema = {"type": "string", "format": fmt}
    assert schema_problem(schema) is None
    assert not accepts(schema, "!! no")


@pytest.mark.parametrize("keyword", sorted(REFUSED_CASES))
def test_a_refused_keyword_is_one_xgrammar_ignores(keyword: str) -> None:
    schema, bad = REFUSED_CASES[keyword]
    assert accepts(schema, bad)  # what the refusal prevents: output that breaks the schema
    problem = schema_problem(schema)
    assert problem is not None and keyword in problem


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    return save_word_tokenizer(tmp_path_factory.mktemp("words"), 64)


@pytest.fixture
def backend(tokenizer: object) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, 64, torch.device("cpu"), stop_token_ids=[2], max_rows=2)


@pytest.mark.parametrize(
    "schema,says",
    [
        (
            {"type": "object", "properties": {"tags": {**INT_LIST, "uniqueItems": True}}},
            "the JSON-schema keyword 'uniqueItems' (at #/properties/tags) is not enforced",
        ),
        ({"type": "string", "format": "email-ish"}, "format 'email-ish' (at #) is not enforced; enforced formats:"),
        (
            {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}},
            "$ref 'http://example.com/a.json' (at #/properties/a) is not inside this schema; remote schemas are "
            "never fetched",
        ),
        ({"anyOf": [{"type": "string", "maxlength": 3}]}, "'maxlength' (at #/anyOf/0) is not enforced"),
        ({"anyOf": [{"type": "string", "maxlength": 3}]}, "did you mean 'maxLength'?"),
        ({"$defs": {"x": {"not": {}}}, "$ref": "#/$defs/x"}, "'not' (at #/$defs/x)"),
        ({"anyOf": []}, "anyOf (at #) lists no schema, so no value satisfies it"),
        ({"type": "array", "items": [1]}, None),  # a malformed keyword is xgrammar's to refuse
    ],
)
def test_the_backend_refuses_before_compiling(
    backend: XGrammarBackend, schema: dict[str, Any], says: str | None
) -> None:
    with pytest.raises(ValidationError) as info:
        backend.compile("json_schema", json.dumps(schema))
    assert info.value.field == "response_format"
    assert says is None or says in info.value.message, info.value.message
    assert backend._compiler is None or says is None  # refused before xgrammar saw it


def test_annotations_pass() -> None:
    schema = {"title": "T", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
              "type": "object", "properties": {"a": {"type": "integer", "default": 1, "examples": [2]}}}  # fmt: skip
    assert schema_problem(schema) is None
    assert not accepts(schema, {"a": "x"})  # the schema around them is enforced


def test_replies_are_compact_json() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": INT_LIST}, "required": ["a", "b"]}
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **COMPACT)
    assert _is_grammar_accept_string(grammar, '{"a":1,"b":[1,2]}')
    assert not _is_grammar_accept_string(grammar, '{"a": 1, "b": [1, 2]}')
    any_object = xgrammar.Grammar.from_json_schema('{"type": "object"}', **COMPACT)
    assert _is_grammar_accept_string(any_object, '{"x":[1,{"y":null}]}')
    assert not _is_grammar_accept_string(any_object, '{"x": 1}')


@pytest.mark.parametrize("kind,text", [("ebnf", 'root ::= root "w5"'), ("regex", r"[^\s\S]")])
def test_a_grammar_no_string_satisfies_is_refused(backend: XGrammarBackend, kind: str, text: str) -> None:
    with pytest.raises(ValidationError, match="no string satisfies this") as info:
        backend.compile(kind, text)
    assert info.value.field == "grammar"
    backend.compile("ebnf", 'root ::= "w5" x\nx ::= "w6"')  # one that does is compiled
