"""Request bodies (no server): every OpenAI field is honoured or refused, unknown fields are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError as PydanticError
from serverutil import TOOL

from minisgl.core import ValidationError
from minisgl.server.protocol import (
    PENDING,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

MESSAGES = [{"role": "user", "content": "hi"}]
JSON = {"type": "json_object"}

# The request fields of OpenAI's API reference (chat completions and legacy completions).
OPENAI_CHAT_FIELDS = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
}  # fmt: skip
OPENAI_COMPLETION_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
}  # fmt: skip


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def refused(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        body.check_supported()
    return info.value.field, info.value.message


def test_every_openai_field_is_declared() -> None:
    assert set(ChatCompletionRequest.model_fields) >= OPENAI_CHAT_FIELDS
    assert set(CompletionRequest.model_fields) >= OPENAI_COMPLETION_FIELDS
    # What is refused unless it asks for nothing is declared on a request model.
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert set(PENDING) | set(UNSUPPORTED) <= declared


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}},
        {"tools": []},
        {"tools": [TOOL], "tool_choice": "none"},
        {"tools": [TOOL], "tool_choice": "auto"},
        {"tools": [TOOL], "parallel_tool_calls": True},
        {"functions": []},
        {"function_call": "none"},
        {"logit_bias": {}},
        {"logit_bias": {"42": 0}},
        {"modalities": ["text"]},
        {"store": False},
        {"service_tier": "auto"},
        {"prompt_cache_retention": "in-memory"},
        {"user": "u1", "safety_identifier": "s", "prompt_cache_key": "k", "metadata": {"a": "b"}},
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
        {"logprobs": True, "top_logprobs": 3},
        {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [2]},
    ],
)
def test_no_op_values_are_accepted(fields: dict[str, Any]) -> None:
    chat(**fields).check_supported()


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        # As at OpenAI: tool_choice and parallel_tool_calls only with tools, even when they ask for nothing.
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
        ({"tool_choice": "none"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": [], "tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools are given"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "not among the tools"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tools": [TOOL], "tool_choice": {"name": "get_weather"}}, "tool_choice", '{"type": "function"'),
        ({"tools": [TOOL, TOOL]}, "tools", "unique"),
        ({"tools": [TOOL], "tool_choice": "required", "regex": "a+"}, "regex", "cannot be combined"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": JSON}, "response_format", "combined"),
        ({"response_format": JSON, "regex": "a+"}, "regex", "at most one of"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf", "at most one of"),
        ({"functions": [{"name": "f"}]}, "functions", "send them as tools"),
        ({"function_call": {"name": "f"}}, "function_call", "send tool_choice"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
        ({"modalities": ["text", "audio"]}, "modalities", '["text"]'),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "leave it out"),
        ({"verbosity": "low"}, "verbosity", "leave it out"),
        ({"web_search_options": {}}, "web_search_options", "web search"),
        ({"store": True}, "store", "stores no completions"),
        ({"service_tier": "flex"}, "service_tier", "one service tier"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in memory"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", ""),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs: true"),
    ],
)
def test_unsupported_values_are_refused(fields: dict[str, Any], field: str, says: str) -> None:
    got_field, message = refused(chat(**fields))
    assert got_field == field
    assert says in message


def test_structured_output_becomes_the_grammar() -> None:
    assert chat().params(0).grammar is None
    assert chat(response_format={"type": "text"}).params(0).grammar is None
    assert chat(response_format=JSON).params(0).grammar == ("json", "")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    body = chat(response_format=fmt)
    body.check_supported()
    assert body.params(0).grammar == ("json_schema", json.dumps(schema))
    assert body.grammar()[1] == "response_format"
    assert chat(regex="[0-9]+").params(1).grammar == ("regex", "[0-9]+")
    assert completion(ebnf='root ::= "a"').params(0).grammar == ("ebnf", 'root ::= "a"')
    assert completion(regex="x").grammar()[1] == "regex"


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "json"},
        {"type": "json_object", "schema": {}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "colour": 1}},
        {"type": "json_schema"},
    ],
)
def test_bad_response_formats_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(PydanticError) as info:
        chat(response_format=bad)
    assert info.value.errors()[0]["loc"] == ("response_format",)


def test_logit_bias() -> None:
    body = chat(logit_bias={"42": 5, "7": -100, "9": 0})
    body.check_supported()
    body.check_vocab(100)
    assert body.params(0).logit_bias == {42: 5.0, 7: -100.0}  # a zero bias asks for nothing
    assert chat(logit_bias={"3": 0}).params(0).logit_bias is None
    with pytest.raises(ValidationError, match=r"token id 100 is outside the vocabulary \[0, 100\)") as info:
        chat(logit_bias={"100": 1}).check_vocab(100)
    assert info.value.field == "logit_bias"
    for bad in ({"x": 1}, {"-1": 1}, {"1": 101}, {"1": -100.5}, {"١": 1}):
        with pytest.raises(PydanticError) as err:
            completion(logit_bias=bad)
        assert err.value.errors()[0]["loc"][0] == "logit_bias"


def test_tool_modes_and_template_tools() -> None:
    assert chat().tool_mode() == ("off", None) and chat().template_tools() is None
    assert chat(tools=[TOOL]).tool_mode() == ("auto", None)
    assert chat(tools=[TOOL], tool_choice="none").template_tools() is None  # the model must not call
    assert chat(tools=[TOOL], tool_choice="required").tool_mode() == ("required", None)
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    named.check_supported()
    assert named.tool_mode() == ("named", "get_weather")
    assert named.template_tools() == [TOOL]
    grammar, field = named.grammar()
    assert field == "tool_choice" and grammar is not None and grammar[0] == "json_schema"
    assert json.loads(grammar[1]) == TOOL["function"]["parameters"]  # type: ignore[index]
    required = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False).grammar()[0]
    assert required is not None
    schema = json.loads(required[1])
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"const": "get_weather"}
    bare = chat(tools=[{"type": "function", "function": {"name": "now"}}]).template_tools()
    assert bare == [
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    ]
    with pytest.raises(PydanticError):
        chat(tools=[{"type": "custom", "custom": {"name": "x"}}])
    with pytest.raises(PydanticError, match="1 to 64"):
        chat(tools=[{"type": "function", "function": {"name": "no spaces"}}])


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"echo": True}, "echo", "echoing"),
        ({"suffix": "end"}, "suffix", "suffixes"),
        ({"best_of": 3}, "best_of", "set it equal to n"),
        ({"best_of": 1, "n": 2}, "best_of", "at least n"),
        ({"regex": "a", "ebnf": "b"}, "ebnf", "at most one"),
    ],
)
def test_completion_refusals(fields: dict[str, Any], field: str, says: str) -> None:
    got_field, message = refused(completion(**fields))
    assert got_field == field and says in message


def test_best_of_equal_to_n_is_accepted() -> None:
    completion(best_of=1).check_supported()
    completion(best_of=3, n=3).check_supported()
    completion(echo=False, suffix="").check_supported()


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_unknown_fields_are_refused(model: type[Any]) -> None:
    base = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "x"}
    with pytest.raises(PydanticError) as info:
        model.model_validate({**base, "frobnicate": 1})
    assert info.value.errors()[0]["type"] == "extra_forbidden"
    assert info.value.errors()[0]["loc"] == ("frobnicate",)


def test_message_fields() -> None:
    msg = {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "calc"}
    body = ChatCompletionRequest.model_validate({"messages": [msg]})
    assert body.plain_messages() == [{"role": "tool", "content": "42", "name": "calc", "tool_call_id": "call_1"}]
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    body = ChatCompletionRequest.model_validate({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": calls}]})
    # As transformers' chat templates take them: the arguments as an object.
    want = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert body.plain_messages()[1] == {"role": "assistant", "content": "", "tool_calls": want}
    for bad, where in (
        ([{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}], "assistant"),
        ([{"id": "c", "type": "function", "function": {"name": "f"}}], "assistant"),
        ([{"type": "code", "function": {"name": "f", "arguments": "{}"}}], "assistant"),
        (calls, "user"),
    ):
        body = ChatCompletionRequest.model_validate({"messages": [{"role": where, "tool_calls": bad}]})
        with pytest.raises(ValidationError) as info:
            body.plain_messages()
        assert info.value.field.startswith("messages[0].tool_calls")
    legacy = {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValidationError, match="send the call as tool_calls"):
        ChatCompletionRequest.model_validate({"messages": [legacy]}).plain_messages()
    with pytest.raises(PydanticError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "colour": "red"}]})


def test_content_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert body.plain_messages()[0]["content"] == "ab"
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": image}]})
    with pytest.raises(ValidationError, match="'image_url' are not supported"):
        body.plain_messages()
    extra = [{"type": "text", "text": "a", "cache_control": {}}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": extra}]})
    with pytest.raises(ValidationError) as info:
        body.plain_messages()
    assert info.value.field == "messages[0].content[0].cache_control"


def test_metadata_limits() -> None:
    with pytest.raises(PydanticError, match="at most 16"):
        chat(metadata={str(i): "v" for i in range(17)})
    with pytest.raises(PydanticError, match="at most 64"):
        chat(metadata={"k" * 65: "v"})


def test_tokenize_bodies() -> None:
    assert TokenizeRequest.model_validate({"prompt": "hi"}).source() == "hi"
    assert TokenizeRequest.model_validate({"messages": MESSAGES}).source() == [{"role": "user", "content": "hi"}]
    for bad in ({}, {"prompt": "a", "messages": MESSAGES}):
        with pytest.raises(ValidationError, match="either prompt"):
            TokenizeRequest.model_validate(bad).source()
    with pytest.raises(ValidationError, match="messages only"):
        TokenizeRequest.model_validate({"prompt": "a", "add_generation_prompt": False}).source()
    with pytest.raises(PydanticError):
        TokenizeRequest.model_validate({"prompt": "a", "bogus": 1})
    with pytest.raises(PydanticError, match="not a valid token id"):
        DetokenizeRequest.model_validate({"tokens": [1, -2]})
    with pytest.raises(PydanticError):
        DetokenizeRequest.model_validate({"tokens": ["1"]})


def test_the_body_walker_bounds_depth_and_finds_surrogates_anywhere() -> None:
    from minisgl.server.validate import MAX_JSON_DEPTH, json_problem

    deep: Any = "leaf"
    for _ in range(100_000):  # far deeper than recursion could walk
        deep = {"k": [deep]}
    where, why = json_problem(deep) or ("", "")
    assert where == ".".join(["k[0]"] * (MAX_JSON_DEPTH // 2))  # the first value past the bound
    assert why.startswith(f"nested deeper than {MAX_JSON_DEPTH} levels")
    flat: Any = 0
    for _ in range(MAX_JSON_DEPTH - 1):
        flat = [flat]
    assert json_problem({"a": flat}) is None and json_problem({"a": [flat]}) is not None
    assert json_problem({"a": [{"b": "ok", "c": "x\udc00"}]}) == (
        "a[0].c",
        "the string holds an unpaired surrogate (U+DC00) at character 1; text must be valid Unicode (a character "
        "outside the Basic Multilingual Plane is sent as a surrogate pair or as UTF-8)",
    )
    key_problem = json_problem({"a": {"\ud800": 1}})
    assert key_problem is not None and key_problem[0] == "a" and key_problem[1].startswith("an object key")
    assert json_problem({"a": ["\U0001f600", {"b": None, "c": 1.5}]}) is None
