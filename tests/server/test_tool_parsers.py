"""Tool-call parsers (no server): whole replies, and the same replies streamed piece by piece."""

from __future__ import annotations

import json
from typing import Any

import pytest

from minisgl.server.tools import (
    CallStream,
    ForcedStream,
    ToolCall,
    choose_parser,
    collect_events,
    forced_schema,
    make_stream,
    parse_whole,
)

NAMES = ("get_weather", "get_time")


def whole(parser: str, text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = parse_whole(make_stream(parser, NAMES, parallel), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def streamed(stream: CallStream, chunks: list[str]) -> tuple[list[Any], tuple[str | None, list[ToolCall]]]:
    events = []
    for chunk in chunks:
        events += stream.feed(chunk)
    events += stream.finish()
    return events, collect_events(events)


HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", "Just text.", "Just text.", []),
        ("hermes", HERMES_TWO, "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        # SmolLM2 writes a JSON list in one block.
        (
            "hermes",
            '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
            "</tool_call>",
            None,
            [("get_time", {}), ("get_weather", {"city": "Oslo"})],
        ),
        # Ended (EOS) right after the JSON, without the closing tag.
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
        # Arguments written as a JSON string.
        (
            "hermes",
            '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
            None,
            [("get_time", {"tz": "UTC"})],
        ),  # fmt: skip
        # Malformed JSON or an unknown function: the block stays text; a good block next to it is still a call.
        (
            "hermes",
            '<tool_call>{"name": "get_time", "arguments": {</tool_call>',
            '<tool_call>{"name": "get_time", "arguments": {</tool_call>',
            [],
        ),  # fmt: skip
        (
            "hermes",
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>ok',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>ok',
            [],
        ),  # fmt: skip
        (
            "hermes",
            'a <tool_call>oops</tool_call> b <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "a <tool_call>oops</tool_call> b",
            [("get_time", {})],
        ),  # fmt: skip
        ("hermes", "x < y and <tool_ is not a call", "x < y and <tool_ is not a call", []),
        (
            "llama3",
            '{"name": "get_weather", "parameters": {"city": "Rome"}}',
            None,
            [("get_weather", {"city": "Rome"})],
        ),
        ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
        (
            "llama3",
            '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
            None,
            [("get_time", {}), ("get_weather", {"city": "Rome"})],
        ),
        ("llama3", "The answer is {x}.", "The answer is {x}.", []),
        ("llama3", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
        (
            "llama3",
            '{"name": "get_time", "parameters": {}} and more',
            '{"name": "get_time", "parameters": {}} and more',
            [],
        ),  # fmt: skip
        ("llama3", '{"a": 1}', '{"a": 1}', []),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]',
            None,
            [("get_time", {"tz": "UTC"})],
        ),
        ("mistral", '[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),  # marker skipped as special
        ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ],
)
def test_whole_replies(parser: str, text: str, content: str | None, calls: list[Any]) -> None:
    assert whole(parser, text) == (content, calls)


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize(
    "text",
    [
        HERMES_TWO,
        "Plain answer with < and [ and { in it",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
        '  <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.',
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_equals_whole(parser: str, text: str, size: int) -> None:
    """Fed token by token (or any split, markers cut across chunks), a stream gives the whole reply's result."""
    _, (content, calls) = streamed(make_stream(parser, NAMES), pieces(text, size))
    want_content, want_calls = parse_whole(make_stream(parser, NAMES), text)
    assert content == want_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


def test_streaming_holds_back_a_possible_marker() -> None:
    stream = make_stream("hermes", NAMES)
    assert stream.feed("Sure") == [("content", "Sure")]
    assert stream.feed(" <tool") == []  # maybe the start of <tool_call>: held (the space too)
    assert stream.feed("s are fun") == [("content", " <tools are fun")]
    assert stream.feed(" <tool_c") == []
    assert stream.feed('all>{"name": "get_time",') == []
    events = stream.feed(' "arguments": {}}</tool_call>')
    assert [e[0] for e in events] == ["call"] and events[0][1].name == "get_time"
    assert stream.finish() == []


def test_llama3_streams_plain_text_at_once_and_holds_json() -> None:
    stream = make_stream("llama3", NAMES)
    assert stream.feed("  ") == []
    assert stream.feed("Hello") == [("content", "  Hello")]
    assert stream.feed(" {json}") == [("content", " {json}")]
    stream = make_stream("llama3", NAMES)
    assert stream.feed("<|python") == [] and stream.feed('_tag|>{"name": "get_time"') == []
    assert stream.feed(', "parameters": {}}') == []
    assert [(k, v.name) for k, v in stream.finish()] == [("call", "get_time")]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert whole("hermes", HERMES_TWO, parallel=False) == ("Let me check.", [("get_weather", {"city": "Paris"})])


def test_call_ids_and_openai_shape() -> None:
    _, calls = parse_whole(make_stream("hermes", NAMES), HERMES_TWO)
    shapes = [c.as_openai() for c in calls]
    assert all(s["id"].startswith("call_") and s["type"] == "function" for s in shapes)
    assert len({s["id"] for s in shapes}) == 2
    assert json.loads(shapes[0]["function"]["arguments"]) == {"city": "Paris"}


def test_choose_parser() -> None:
    assert choose_parser("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}") == "hermes"
    assert choose_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3"
    assert choose_parser("{%- if message.role == 'ipython' %}") == "llama3"
    assert choose_parser("[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert choose_parser("<|im_start|>{{ message.content }}") == "hermes"  # none mentioned: the common format
    assert choose_parser(None) == "hermes"
    assert choose_parser("<tool_call>", "llama3") == "llama3"  # the setting wins
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        choose_parser(None, "gpt")


def test_forced_named_streams_the_arguments() -> None:
    stream = ForcedStream("get_weather", NAMES)
    events, (content, calls) = streamed(stream, pieces('{"city": "Paris"}', 4))
    assert events[0][0] == "head" and events[0][1].name == "get_weather"
    assert [e[0] for e in events[1:]] == ["args"] * 5
    assert content is None and len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Paris"}


def test_forced_required_parses_the_list() -> None:
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    _, (content, calls) = streamed(ForcedStream(None, NAMES), pieces(text, 5))
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    _, (content, calls) = streamed(ForcedStream(None, NAMES), ['[{"name": "get_ti'])  # cut by max_tokens
    assert content == '[{"name": "get_ti' and calls == []


def test_forced_schema() -> None:
    fns = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"name": "get_time"},
    ]
    assert forced_schema(fns, "get_weather", True) == fns[0]["parameters"]
    assert forced_schema(fns, "get_time", True) == {"type": "object", "properties": {}}
    schema = forced_schema(fns, None, True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert forced_schema(fns, None, False)["maxItems"] == 1
