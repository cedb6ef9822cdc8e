"""Tool calling: the model's output parsed into OpenAI ``tool_calls``, whole or as it streams (by the same stream).

Formats: ``hermes``, ``llama3``, ``mistral`` (:func:`choose_parser` reads it off the chat template). A call that does
not parse or names a function not offered stays content. With ``tool_choice`` required or named, the request's
grammar (:func:`forced_schema`) makes the raw output the call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text (an object), as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# Events of a stream: ("content", text) | ("call", ToolCall) (head and arguments at once) |
# ("head", ToolCall) (name, arguments to follow) | ("args", fragment) (of the last head).
Event = tuple[str, Any]


class CallStream:
    """Text in, events out. Subclasses implement :meth:`_feed` and :meth:`_finish`."""

    def __init__(self) -> None:
        self.calls = 0  # calls emitted so far
        self.max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls are dropped)
        self._dropping = False
        self._held_ws = ""  # whitespace held back: dropped when a call follows it
        self._after_call = False  # drop the whitespace right after a call

    def feed(self, text: str) -> list[Event]:
        return self._smooth(self._feed(text)) if text else []

    def finish(self) -> list[Event]:
        events = self._smooth(self._finish())
        if self._held_ws:
            events.append(("content", self._held_ws))
            self._held_ws = ""
        return events

    def _feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def _finish(self) -> list[Event]:
        raise NotImplementedError

    def _smooth(self, events: Iterable[Event]) -> list[Event]:
        """Drop the whitespace around calls (a template's line breaks between blocks), merge content."""
        out: list[Event] = []
        for kind, value in events:
            if kind == "content":
                text = self._held_ws + value
                self._held_ws = ""
                if self._after_call:
                    text = text.lstrip()
                    if not text:
                        continue
                    self._after_call = False
                body = text.rstrip()
                self._held_ws = text[len(body) :]
                if body and out and out[-1][0] == "content":
                    out[-1] = ("content", out[-1][1] + body)
                elif body:
                    out.append(("content", body))
                continue
            if kind in ("call", "head"):
                self._dropping = self.max_calls is not None and self.calls >= self.max_calls
                if not self._dropping:
                    self._held_ws = ""
                    self._after_call = True
                    self.calls += 1
            if not self._dropping:
                out.append((kind, value))
        return out


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _calls_from_json(value: Any, names: frozenset[str]) -> list[ToolCall] | None:
    """Calls from a decoded call object or list of them; None if any is not a call of a known tool."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def _decode_all(text: str, separators: str = "") -> list[Any] | None:
    """Every JSON value in ``text``, one after another (between: whitespace and ``separators``)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i, n = 0, len(text)
    skip = " \t\r\n" + separators
    while True:
        while i < n and text[i] in skip:
            i += 1
        if i >= n:
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class HermesStream(CallStream):
    """``<tool_call>JSON</tool_call>`` blocks anywhere in the reply; text between them is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]):
        super().__init__()
        self.names = names
        self.buf = ""
        self.in_block = False

    def _feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            if not self.in_block:
                at = self.buf.find(self.OPEN)
                # Without a block: all but what may be the start of a marker is content.
                cut = len(self.buf) - _held_prefix(self.buf, self.OPEN) if at < 0 else at
                if cut:
                    events.append(("content", self.buf[:cut]))
                self.buf = self.buf[cut:]
                if at < 0:
                    return events
                self.in_block = True
            end = self.buf.find(self.CLOSE)
            if end < 0:
                return events
            end += len(self.CLOSE)
            events += self._block(self.buf[:end], closed=True)
            self.buf = self.buf[end:]
            self.in_block = False

    def _block(self, block: str, closed: bool) -> list[Event]:
        inner = block[len(self.OPEN) : len(block) - (len(self.CLOSE) if closed else 0)]
        values = _decode_all(inner)
        calls = _calls_from_json(values[0], self.names) if values and len(values) == 1 else None
        return [("call", c) for c in calls] if calls else [("content", block)]

    def _finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if self.in_block:  # a block the reply ended inside (EOS right after the JSON): a call if it parses
            return self._block(buf, closed=False)
        return [("content", buf)] if buf else []


class JsonStartStream(CallStream):
    """A reply that *is* the call(s): JSON from its start, maybe after a marker (Llama 3, Mistral). A reply that
    starts otherwise is content, streamed as it comes; one that starts with the marker, ``{`` or ``[`` is held
    until it ends, then parsed (content if it does not parse)."""

    def __init__(self, names: frozenset[str], marker: str, separators: str):
        super().__init__()
        self.names = names
        self.marker = marker
        self.separators = separators
        self.buf = ""
        self.mode = "undecided"  # or "content" or "hold"

    def _feed(self, text: str) -> list[Event]:
        if self.mode == "content":
            return [("content", text)]
        self.buf += text
        if self.mode == "undecided":
            head = self.buf.lstrip()
            if not head or self.marker.startswith(head):
                return []  # only whitespace, or the start of the marker so far
            if head[0] in "{[" or head.startswith(self.marker):
                self.mode = "hold"
                return []
            self.mode = "content"
            buf, self.buf = self.buf, ""
            return [("content", buf)]
        return []

    def _finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if not buf:
            return []
        values = _decode_all(buf.strip().removeprefix(self.marker), self.separators) if self.mode != "content" else None
        found = [_calls_from_json(value, self.names) for value in values or []]
        if not found or any(calls is None for calls in found):
            return [("content", buf)]
        return [("call", c) for calls in found for c in calls or []]


_JSON_START = {"llama3": ("<|python_tag|>", ";"), "mistral": ("[TOOL_CALLS]", "")}  # marker, separators


def make_stream(parser: str, names: Iterable[str], parallel: bool = True) -> CallStream:
    """The stream of ``parser`` for a request offering functions ``names`` (one call at most unless ``parallel``)."""
    known = frozenset(names)
    stream: CallStream
    if parser == "hermes":
        stream = HermesStream(known)
    elif parser in _JSON_START:
        stream = JsonStartStream(known, *_JSON_START[parser])
    else:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")
    stream.max_calls = None if parallel else 1
    return stream


def choose_parser(chat_template: str | None, setting: str = "auto") -> str:
    """The call format of a model (``setting`` other than auto wins). The template writes earlier turns' calls
    in the format the model was trained on, so its markers name it; with none, ``hermes`` (the most common)."""
    if setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"unknown tool-call parser {setting!r}; known: auto, {', '.join(PARSERS)}")
        return setting
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


# ------------------------------------------------------------------ tool_choice required / named
def function_parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def forced_schema(functions: list[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema the reply must follow: the named function's parameters, or (``required``) a non-empty
    list of ``{"name", "arguments"}`` calls of the offered functions (one at most unless ``parallel``)."""
    if named is not None:
        return function_parameters(next(f for f in functions if f["name"] == named))
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": function_parameters(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    items: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ForcedStream(CallStream):
    """The raw output of a request whose grammar forces the call. Named: the output is the function's arguments,
    streamed after the call's head. Required: a JSON list of calls, parsed at the end (content if cut short)."""

    def __init__(self, named: str | None, names: Iterable[str]):
        super().__init__()
        self.named = named
        self.names = frozenset(names)
        self.buf = ""
        self.started = False

    def _feed(self, text: str) -> list[Event]:
        if self.named is None:
            self.buf += text
            return []
        events: list[Event] = [] if self.started else [("head", ToolCall(self.named, ""))]
        self.started = True
        return [*events, ("args", text)]

    def _finish(self) -> list[Event]:
        if self.named is not None:
            return [] if self.started else [("head", ToolCall(self.named, "")), ("args", "{}")]
        buf, self.buf = self.buf, ""
        try:
            calls = _calls_from_json(json.loads(buf), self.names)
        except ValueError:
            calls = None
        if not calls:
            return [("content", buf)] if buf else []
        return [("call", c) for c in calls]


# ------------------------------------------------------------------ whole replies
def collect_events(events: Iterable[Event]) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when there are calls and no text) and calls."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for kind, value in events:
        if kind == "content":
            content.append(value)
        elif kind in ("call", "head"):
            calls.append(ToolCall(value.name, value.arguments, value.id))
        elif kind == "args" and calls:
            calls[-1].arguments += value
    text = "".join(content)
    return (None if calls and not text.strip() else text), calls


def parse_whole(stream: CallStream, text: str) -> tuple[str | None, list[ToolCall]]:
    return collect_events([*stream.feed(text), *stream.finish()])


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates take them: arguments as an object when they
    decode to one (transformers' convention; templates write them with ``tojson``), the id kept."""
    out = []
    for call in calls:
        fn = call["function"]
        try:
            decoded = json.loads(fn["arguments"])
        except ValueError:
            decoded = None
        args = decoded if isinstance(decoded, dict) else fn["arguments"]
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
