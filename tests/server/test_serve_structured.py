"""Structured output and tool calling end to end: a real ``minisgl serve`` of the demo model
(SmolLM2-135M-Instruct), the official ``openai`` client, the engine's grammars (xgrammar)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serverutil import Server, openai_client

pytest.importorskip(
    "minisgl_plugin_xgrammar",
    reason="structured output needs a grammar backend (plugins/minisgl-plugin-xgrammar)",
)

MODEL = "smollm2"
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "capital"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` fits ``schema`` (the keywords this file's schemas use)."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(v, props[k]) for k, v in value.items() if k in props)
    return kind is None


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        smollm2_path,
        tmp_path_factory.mktemp("structured"),
        "--max-model-len", "1024",
        "--num-pages", "256",
        "--served-model-name", MODEL,
        "--grammar-compile-timeout", "3",
    )  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai_client(server)


def streamed_calls(chunks: list[Any]) -> tuple[str, list[dict[str, Any]], list[str]]:
    """Content, tool calls (reassembled from their deltas) and finish reasons of a streamed reply."""
    content, calls, finishes = "", [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:
                assert part.index == len(calls) and part.type == "function" and part.function.name
                calls.append({"id": part.id, "name": part.function.name, "arguments": part.function.arguments or ""})
            else:
                assert part.index == len(calls) - 1
                calls[part.index]["arguments"] += part.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    return content, calls, finishes


def test_json_schema_output(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe the capital of France as JSON."}],
        "response_format": fmt,
        "temperature": 0,
        "max_tokens": 80,
    }
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop", text
    assert conforms(json.loads(text), CITY), text
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_json_object_output(client: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "List three colours."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_tool_call_flow(client: Any) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, temperature=0, max_tokens=100
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert conforms(args, WEATHER["function"]["parameters"]), args  # type: ignore[index]
    # The tool's result goes back as a tool message; the model answers in words.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=24
    )
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("parallel", [False])
def test_required_tool_calls_streamed_and_not(client: Any, parallel: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What time is it in Tokyo, and the weather in Oslo?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "temperature": 0,
        "max_tokens": 80,
    }
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "tool_calls"
    calls = full.choices[0].message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]
    for call in calls:
        assert conforms(json.loads(call.function.arguments), schemas[call.function.name])
    content, streamed, finishes = streamed_calls(list(client.chat.completions.create(**kwargs, stream=True)))
    assert content == "" and finishes == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


def test_named_tool_call_streams_its_arguments(client: Any) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": named, "max_tokens": 40, "seed": 3,
    }  # fmt: skip
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content, calls, finishes = streamed_calls(chunks)
    assert content == "" and finishes == ["tool_calls"] and len(calls) == 1 and calls[0]["name"] == "get_time"
    assert conforms(json.loads(calls[0]["arguments"]), TIME["function"]["parameters"])  # type: ignore[index]
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.tool_calls[0].function.arguments == calls[0]["arguments"]


def test_regex_and_logit_bias(client: Any) -> None:
    out = client.completions.create(
        model=MODEL, prompt="The year the Eiffel Tower opened:", max_tokens=6, temperature=0,
        extra_body={"regex": "[0-9]{4}"},
    )  # fmt: skip
    assert len(out.choices[0].text) == 4 and out.choices[0].text.isdigit()
    base: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 3, "temperature": 0}
    first = client.chat.completions.create(**base, logprobs=True)
    token = first.choices[0].logprobs.content[0].token
    ids = client.post("/../tokenize", cast_to=object, body={"prompt": token, "add_special_tokens": False})
    banned = client.chat.completions.create(**base, logit_bias={str(ids["tokens"][0]): -100})
    assert banned.choices[0].message.content != first.choices[0].message.content
    bad = pytest.importorskip("openai").BadRequestError
    with pytest.raises(bad, match="logit_bias: token id 99999999 is outside the vocabulary"):
        client.chat.completions.create(**base, logit_bias={"99999999": 5})


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_a_constrained_reply_are_json_and_allowed_tokens_only(server: Server) -> None:
    """A digit-only regex allows ten-odd tokens: asking for 20 alternatives lists only allowed ones, all finite."""
    import httpx

    bodies = [
        ("/v1/completions", {"prompt": "The year:", "logprobs": 20}),
        ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 20}),
    ]
    for path, body in bodies:
        for stream in (False, True):
            full = {"model": MODEL, "max_tokens": 4, "temperature": 0, "regex": "[0-9]{4}", "stream": stream, **body}
            resp = httpx.post(server.url + path, json=full, timeout=120)
            assert resp.status_code == 200, resp.text
            events = (
                [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")][:-1]
                if stream
                else [resp.text]
            )
            alternatives: list[str] = []
            for event in events:
                for choice in _strict(event)["choices"]:
                    lp = choice["logprobs"]
                    if not lp:
                        continue
                    if "content" in lp:
                        alternatives += [a["token"] for c in lp["content"] for a in c["top_logprobs"]]
                    else:
                        alternatives += [a for top in lp["top_logprobs"] for a in top]
            # Digits, or the end-of-sequence token once four digits are written.
            assert alternatives and all(a.isdigit() or a.startswith("<|") for a in alternatives), alternatives


def test_an_unenforced_schema_keyword_is_400_naming_it(client: Any) -> None:
    bad = pytest.importorskip("openai").BadRequestError
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    with pytest.raises(bad, match="response_format: the JSON-schema keyword 'uniqueItems'"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=fmt)
    remote = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"$ref": "https://example.com/s.json"}}}
    with pytest.raises(bad, match="remote schemas are never fetched"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=remote)


def test_a_slow_grammar_is_a_400_at_its_limit_and_the_streams_go_on(server: Server) -> None:
    """A 60-byte schema that would compile for many seconds: refused at the server's limit (3 s here) while another
    stream keeps receiving tokens and /health stays 200; it leaves nothing behind."""
    import threading

    import httpx

    chunks: list[float] = []
    stream_body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=stream_body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    while not chunks:
        time.sleep(0.05)
    slow = {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "[a-z]{1,12000}"}},
    }
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "response_format": slow}
    sent = time.monotonic()
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    answered = time.monotonic()
    health = httpx.get(server.url + "/health", timeout=10).status_code
    reader.join()
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format" and "took longer than 3 s" in error["message"]
    assert sum(1 for t in chunks if sent < t < answered) >= 10  # the other stream went on meanwhile
    assert health == 200
    idle = ("minisgl_num_requests_running 0.0", "minisgl_num_requests_compiling 0.0", "minisgl_kv_pages_used 0.0")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        if all(line in metrics for line in idle):
            break
        time.sleep(0.2)
    assert all(line in metrics for line in idle), metrics


def test_a_grammar_whose_masks_get_slow_ends_with_grammar_error(server: Server) -> None:
    """An ambiguous grammar's masks grow slower with each character: the reply ends with grammar_error at the mask
    budget instead of slowing every stream (end-of-text banned, so only the grammar can end it early)."""
    import httpx

    body = {
        "model": MODEL,
        "prompt": "Letters:",
        "max_tokens": 1000,
        "ebnf": 'root ::= s\ns ::= s s s s | s s s | s s | "a" | "b" | ""',
        "logit_bias": {"0": -100, "1": -100, "2": -100},
    }
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "grammar_error"
    assert set(choice["text"]) <= {"a", "b"} and 0 < resp.json()["usage"]["completion_tokens"] < 1000
