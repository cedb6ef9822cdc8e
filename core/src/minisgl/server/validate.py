"""The check every request body passes before its fields are read: bounded nesting and valid Unicode, at any depth.

One walker, without recursion, visits every value of the decoded body (and of a JSON text inside it, such as a tool
call's ``arguments``): no field escapes it, and no value reaches msgpack, a chat template or a grammar compiler
with a lone surrogate or a nesting that would overflow a recursive consumer.
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64  # nesting of objects and arrays in the body, and in a JSON text it carries


class BodyError(Exception):
    """A request body that is refused before it is validated field by field (a 400 naming ``field``).

    Not a ``ValueError``, so pydantic passes it through instead of reporting it against the body as a whole."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def surrogate_message(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"the string holds an unpaired surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}; "
            "text must be valid Unicode (a character outside the Basic Multilingual Plane is sent as a "
            "surrogate pair or as UTF-8)"
        )
    return None


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def json_problem(value: Any, path: str = "") -> tuple[str, str] | None:
    """(where, why) for the first value in ``value`` nested deeper than :data:`MAX_JSON_DEPTH` or holding a lone
    surrogate (in a string or an object key), or None. ``where`` is ``messages[0].content``-style, from ``path``."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, str):
            problem = surrogate_message(node)
            if problem is not None:
                return where, problem
        elif isinstance(node, dict | list):
            if depth >= MAX_JSON_DEPTH:
                return where, f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays; flatten it"
            if isinstance(node, list):
                stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in reversed(list(enumerate(node))))
                continue
            children = []
            for key, item in node.items():
                problem = surrogate_message(key) if isinstance(key, str) else None
                if problem is not None:
                    return where, f"an object key: {problem}"
                children.append((item, _key_path(where, key), depth + 1))
            stack.extend(reversed(children))
    return None


def check_body(value: Any) -> None:
    """Raise :class:`BodyError` for the first problem :func:`json_problem` finds in a request body."""
    problem = json_problem(value)
    if problem is not None:
        where, why = problem
        raise BodyError(where or "body", why)
