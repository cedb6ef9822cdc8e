"""Which JSON-schema keywords the xgrammar backend enforces; a schema using any other is refused before it is
compiled, so a reply never claims to follow a schema it was not held to.

The sets were measured against xgrammar 0.2.9 (compact separators, strict mode): for each keyword, a string
that breaks it must be rejected by the compiled grammar (``tests/test_xgrammar_schema.py`` keeps that true).
xgrammar accepts and ignores ``uniqueItems``, ``not``, ``contains``, ``if``/``then``/``else``,
``dependentRequired``, ``dependentSchemas``, ``allOf`` of several schemas, ``oneOf`` with overlapping branches
(read as ``anyOf``), unknown ``format`` names, and a ``$ref`` outside the document (it matches any JSON then):
those are refused.
"""

from __future__ import annotations

import difflib
from typing import Any

# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
ONE_SCHEMA = frozenset({"additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems"})
SCHEMA_LIST = frozenset({"anyOf", "prefixItems", "allOf"})
SCHEMA_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions"})
# Keywords enforced as they are (their value is data, not a schema).
VALUE_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "required",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minItems", "maxItems", "minProperties", "maxProperties",
        "$ref",
    }
)  # fmt: skip
# Annotations: they describe, they do not constrain, so nothing is lost by not enforcing them.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
     "writeOnly"}
)  # fmt: skip
ENFORCED = ONE_SCHEMA | SCHEMA_LIST | SCHEMA_MAP | VALUE_KEYWORDS
FORMATS = frozenset(
    {"email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uri-template", "hostname",
     "ipv4", "ipv6", "uuid", "json-pointer", "relative-json-pointer"}
)  # fmt: skip
HINTS = {
    "allOf": "merge the schemas into one",
    "oneOf": "send anyOf (a value matching several branches is then allowed)",
    "not": "describe the allowed values instead (enum, pattern, ranges)",
    "if": "express the condition with anyOf",
    "then": "express the condition with anyOf",
    "else": "express the condition with anyOf",
    "contains": "describe every item with items",
    "uniqueItems": "leave it out and check the values after",
}


def _refused(where: str, keyword: str) -> str:
    hint = HINTS.get(keyword)
    if hint is None:
        close = difflib.get_close_matches(keyword, sorted(ENFORCED), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "leave it out"
    return (
        f"the JSON-schema keyword {keyword!r} (at {where}) is not enforced by the grammar engine, so the output "
        f"could break it; {hint}. Enforced: {', '.join(sorted(ENFORCED))}"
    )


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` (a decoded JSON schema) cannot be enforced as it is, or None. Walks without recursion."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"a schema is an object or a boolean, got {type(node).__name__} at {where}"
        for key, value in node.items():
            at = f"{where}/{key}"
            if key in ANNOTATIONS:
                continue
            if key not in ENFORCED:
                return _refused(where, key)
            if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                return (
                    f"$ref {value!r} (at {where}) is not inside this schema; remote schemas are never fetched: put "
                    "the definition under $defs and refer to it as #/$defs/NAME"
                )
            if key == "format" and value not in FORMATS:
                return f"format {value!r} (at {where}) is not enforced; enforced formats: {', '.join(sorted(FORMATS))}"
            if key == "anyOf" and value == []:
                return f"anyOf (at {where}) lists no schema, so no value satisfies it"
            if key == "allOf" and isinstance(value, list) and len(value) > 1:
                return _refused(where, key) + " (allOf of one schema is enforced)"
            if key in ONE_SCHEMA and not (key == "items" and isinstance(value, list)):
                stack.append((value, at))
            elif key in SCHEMA_LIST and isinstance(value, list):
                stack.extend((item, f"{at}/{i}") for i, item in enumerate(value))
            elif key in SCHEMA_MAP and isinstance(value, dict):
                stack.extend((item, f"{at}/{name}") for name, item in value.items())
    return None
