"""Request bodies (no server): every OpenAI field is honoured or refused, unknown fields are refused."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError as PydanticError

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
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"parallel_tool_calls": True},
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
        ({"response_format": {"type": "json_object"}}, "response_format", "structured output"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "not supported yet"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
        ({"tool_choice": "required"}, "tool_choice", "tool calling"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "leave tool_choice out"),
        ({"functions": [{"name": "f"}]}, "functions", "function calling"),
        ({"function_call": {"name": "f"}}, "function_call", "function calling"),
        ({"logit_bias": {"42": 5}}, "logit_bias", "logit_bias is not supported yet"),
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


def test_tool_choice_with_tools_is_refused_by_the_tools() -> None:
    body = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert refused(body)[0] == "tools"


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"echo": True}, "echo", "echoing"),
        ({"suffix": "end"}, "suffix", "suffixes"),
        ({"best_of": 3}, "best_of", "set it equal to n"),
        ({"best_of": 1, "n": 2}, "best_of", "at least n"),
        ({"logit_bias": {"1": -100}}, "logit_bias", "not supported yet"),
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
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = ChatCompletionRequest.model_validate({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": calls}]})
    with pytest.raises(ValidationError) as info:
        body.plain_messages()
    assert info.value.field == "messages[1].tool_calls" and "tool calling" in info.value.message
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
