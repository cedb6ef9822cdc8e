"""The FastAPI app without a model or workers: a fake engine answers every job, a real tokenizer tokenizes.

Covers what the app decides by itself: refusals of unsupported fields and unknown arguments,
``/tokenize`` and ``/detokenize``, ``GET /v1/models/{id}`` and the API key on the new routes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serverutil import TOOL
from transformers import AutoTokenizer

from minisgl.core import LOGPROB_FLOOR
from minisgl.message import GenerateReq, TokenizerLimits
from minisgl.server.app import create_app
from minisgl.server.launcher import Health
from minisgl.server.settings import ServeSettings
from minisgl.server.text_tools import TextTools
from minisgl.server.validate import MAX_JSON_DEPTH
from minisgl.tokenizer.worker import TokenizerService

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 64
VOCAB = 49152
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
REPLY: list[str] = []  # what the fake engine answers, piece by piece (empty: "Paris.")
FAIL: list[str] = []  # (field, message): the fake engine refuses the request
LOGPROBS: list[Any] = []  # the logprob entries the fake engine sends with its first piece
tasks: set[Any] = set()


class Workers:
    tokenizers = ["tokenizer-0"]

    def check(self) -> str | None:
        return None

    def health(self, silence: float, stall: float) -> Health:
        return Health(None, {})


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def api(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, list[GenerateReq]]]:
    sockets = tmp_path_factory.mktemp("sock")
    addresses = {name: f"ipc://{sockets}/{name}.sock" for name in ("api", "tokenizer-0")}
    settings = ServeSettings(model="/models/tiny", api_key=KEY)
    text = TextTools(lambda: tokenizer, MAX_LEN, VOCAB)
    info = {"max_model_len": MAX_LEN, "vocab_size": VOCAB, "attention_backend": "torch", "prefix_cache": "radix"}
    app = create_app(settings, addresses, info, Workers(), text=text)
    submitted: list[GenerateReq] = []

    async def submit(req: GenerateReq, sink: Any) -> None:  # the fake engine: REPLY's pieces (one word), then stop
        submitted.append(req)
        if FAIL:
            sink.on_failed(*FAIL)
            return
        pieces = REPLY or ["Paris."]
        sink.on_output(pieces[0], 1, list(LOGPROBS) or None, ["stop", 7, 0] if len(pieces) == 1 else None)

        async def rest() -> None:  # the other pieces arrive later, each on its own
            for i, piece in enumerate(pieces[1:], 2):
                await asyncio.sleep(0.002)
                sink.on_output(piece, i, None, ["stop", 7, 0] if i == len(pieces) else None)

        if len(pieces) > 1:
            tasks.add(asyncio.create_task(rest()))

    with TestClient(app) as client:
        app.state.client.submit = submit
        client.headers.update(AUTH)
        yield client, submitted


def error_of(resp: Any, status: int, param: str | None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    return str(err["message"])


def test_no_op_values_reach_the_engine(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, submitted = api
    body = {
        "messages": MESSAGES,
        "response_format": {"type": "text"},
        "tools": [TOOL],
        "tool_choice": "none",
        "logit_bias": {},
        "user": "me",
        "top_k": 3,
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Paris."
    assert submitted[-1].params["top_k"] == 3
    resp = client.post("/v1/completions", json={"prompt": "x", "best_of": 2, "n": 2})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json"}}, "response_format", "expected"),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {}}]},
            "tools[0].function.name",
            "required",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "send them as tools"),
        ("/v1/chat/completions", {"logit_bias": {str(VOCAB): 10}}, "logit_bias", f"token id {VOCAB} is outside"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ("/v1/completions", {"regex": "a", "ebnf": "b"}, "ebnf", "at most one"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
        ("/v1/completions", {"best_of": 4}, "best_of", "equal to n"),
        ("/v1/completions", {"echo": True}, "echo", "echoing"),
    ],
)
def test_refusals_name_the_field(
    api: tuple[TestClient, list[GenerateReq]], path: str, body: dict[str, Any], param: str, says: str
) -> None:
    client, submitted = api
    before = len(submitted)
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    message = error_of(client.post(path, json={**base, **body}), 400, param)
    assert message.startswith(f"{param}: ") and says in message
    assert len(submitted) == before  # refused before anything reached the workers


def test_unknown_argument_is_refused_like_openai(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    resp = client.post("/v1/chat/completions", json={"messages": MESSAGES, "frobnicate": True})
    assert error_of(resp, 400, "frobnicate").startswith("Unrecognized request argument supplied: frobnicate")
    bad_msg = [{"role": "user", "content": "x", "colour": "red"}]
    resp = client.post("/v1/chat/completions", json={"messages": bad_msg})
    assert "messages[0].colour" in error_of(resp, 400, "messages[0].colour")


HERMES = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def reply() -> Iterator[list[str]]:
    REPLY.clear()
    FAIL.clear()
    yield REPLY
    REPLY.clear()
    FAIL.clear()


def sse_chunks(resp: Any) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    lines = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tool_call_in_the_reply(api: tuple[TestClient, list[GenerateReq]], reply: list[str]) -> None:
    client, submitted = api
    reply += [HERMES]
    resp = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [TOOL]})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # The tools went to the chat template (in the tokenizer worker); no grammar under auto.
    assert submitted[-1].tools == [TOOL] and submitted[-1].params["grammar"] is None


def test_tool_call_streamed(api: tuple[TestClient, list[GenerateReq]], reply: list[str]) -> None:
    client, _ = api
    reply += [HERMES[i : i + 3] for i in range(0, len(HERMES), 3)]  # the marker split across chunks
    body = {"messages": MESSAGES, "tools": [TOOL], "stream": True}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=body))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking." and not any("<" in (d.get("content") or "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, *args = calls
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert all(a["index"] == 0 and "id" not in a for a in args)
    assert json.loads("".join(a["function"]["arguments"] for a in args)) == {"city": "Paris"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_tool_choice_named_and_required_send_a_schema(
    api: tuple[TestClient, list[GenerateReq]], reply: list[str]
) -> None:
    client, submitted = api
    reply += ['{"city": ', '"Paris"}']
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        body = {"messages": MESSAGES, "tools": [TOOL], "tool_choice": named, "stream": stream}
        resp = client.post("/v1/chat/completions", json=body)
        kind, schema = submitted[-1].params["grammar"]
        assert kind == "json_schema" and json.loads(schema) == TOOL["function"]["parameters"]  # type: ignore[index]
        if stream:
            deltas = [c["choices"][0]["delta"] for c in sse_chunks(resp)]
            calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
            assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
            assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"city": "Paris"}'
        else:
            message = resp.json()["choices"][0]["message"]
            assert message["content"] is None and resp.json()["choices"][0]["finish_reason"] == "tool_calls"
            assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    reply[:] = ['[{"name": "get_weather", "arguments": {"city": "Oslo"}}]']
    body = {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    out = client.post("/v1/chat/completions", json=body).json()
    assert json.loads(submitted[-1].params["grammar"][1])["maxItems"] == 1
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tool_choice_none_offers_and_parses_nothing(
    api: tuple[TestClient, list[GenerateReq]], reply: list[str]
) -> None:
    client, submitted = api
    reply += [HERMES]
    out = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [TOOL], "tool_choice": "none"})
    assert submitted[-1].tools is None
    choice = out.json()["choices"][0]
    assert choice["message"]["content"] == HERMES and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_unknown_function_stays_text(api: tuple[TestClient, list[GenerateReq]], reply: list[str]) -> None:
    client, _ = api
    text = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    reply += [text]
    out = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [TOOL]}).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert out["choices"][0]["finish_reason"] == "stop"


def test_tool_history_reaches_the_template(api: tuple[TestClient, list[GenerateReq]], reply: list[str]) -> None:
    client, submitted = api
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ]
    resp = client.post("/v1/chat/completions", json={"messages": msgs, "tools": [TOOL]})
    assert resp.status_code == 200, resp.text
    sent = submitted[-1].messages
    assert sent is not None
    assert sent[1]["tool_calls"] == [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert sent[2] == {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"}


def test_structured_output_and_logit_bias_reach_the_engine(
    api: tuple[TestClient, list[GenerateReq]], reply: list[str]
) -> None:
    client, submitted = api
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    for stream in (False, True):
        resp = client.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "response_format": fmt, "logit_bias": {"5": -100, "9": 2}, "stream": stream},
        )
        assert resp.status_code == 200, resp.text
        assert submitted[-1].params["grammar"] == ["json_schema", json.dumps(schema)]
        assert sorted(submitted[-1].params["logit_bias"]) == [[5, -100.0], [9, 2.0]]
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": {"type": "json_object"}})
    assert submitted[-1].params["grammar"] == ["json", ""]
    client.post("/v1/completions", json={"prompt": "x", "regex": "[0-9]+"})
    assert submitted[-1].params["grammar"] == ["regex", "[0-9]+"]
    client.post("/v1/completions", json={"prompt": "x", "ebnf": 'root ::= "a"'})
    assert submitted[-1].params["grammar"] == ["ebnf", 'root ::= "a"']


def test_a_grammar_the_engine_refuses_names_the_request_field(
    api: tuple[TestClient, list[GenerateReq]], reply: list[str]
) -> None:
    client, _ = api
    FAIL[:] = ["grammar", "cannot compile the grammar: bad"]
    resp = client.post("/v1/completions", json={"prompt": "x", "regex": "(", "stream": True})
    assert "cannot compile" in error_of(resp, 400, "regex")
    named = {"type": "function", "function": {"name": "get_weather"}}
    FAIL[:] = ["response_format", "bad schema"]
    resp = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [TOOL], "tool_choice": named})
    assert error_of(resp, 400, "tool_choice") == "tool_choice: bad schema"


def test_tokenize_with_tools(api: tuple[TestClient, list[GenerateReq]], tokenizer: Any) -> None:
    client, _ = api
    resp = client.post("/tokenize", json={"messages": MESSAGES, "tools": [TOOL]})
    assert resp.status_code == 200, resp.text
    assert "messages only" in error_of(client.post("/tokenize", json={"prompt": "x", "tools": [TOOL]}), 400, "tools")


def test_tools_reach_a_template_that_renders_them(tokenizer: Any) -> None:
    """The template gets ``tools`` (as transformers' templates take them), in /tokenize as in the workers."""
    from copy import deepcopy

    from minisgl.tokenizer.worker import apply_template

    tok = deepcopy(tokenizer)
    tok.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    assert apply_template(tok, MESSAGES, [TOOL], False) == "[get_weather]" + MESSAGES[0]["content"]
    text = TextTools(lambda: tok, MAX_LEN, VOCAB)
    try:
        ids, _ = asyncio.run(text.tokenize(MESSAGES, False, True, False, [TOOL]))
        assert tok.decode(ids).startswith("[get_weather]")
    finally:
        text.close()


def test_tokenize_prompt_and_messages(api: tuple[TestClient, list[GenerateReq]], tokenizer: Any) -> None:
    client, _ = api
    resp = client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["tokens"] == tokenizer.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == MAX_LEN and "token_strs" not in out
    out = client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True})
    assert out.json()["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello"))
    chat_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    out = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert out["tokens"] == tokenizer.encode(chat_text, add_special_tokens=False)
    no_gen = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_gen["count"] < out["count"]


def test_detokenize_round_trip(api: tuple[TestClient, list[GenerateReq]], tokenizer: Any) -> None:
    client, _ = api
    ids = tokenizer.encode("Héllo wörld 🙂")
    resp = client.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": "Héllo wörld 🙂"}


def test_tokenize_bad_input(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    assert "'gpt-4'" in error_of(client.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert "either prompt" in error_of(client.post("/tokenize", json={}), 400, "prompt")
    long = error_of(client.post("/tokenize", json={"prompt": "word " * 200}), 400, "prompt")
    assert f"more than the context length {MAX_LEN}" in long
    out_of_vocab = error_of(client.post("/detokenize", json={"tokens": [1, VOCAB]}), 400, "tokens")
    assert f"token id {VOCAB} (item 1) is outside the vocabulary" in out_of_vocab
    assert "not a valid token id" in error_of(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    too_many = error_of(client.post("/detokenize", json={"tokens": [1] * (MAX_LEN + 1)}), 400, "tokens")
    assert "more than the context length" in too_many
    assert "Unrecognized" in error_of(client.post("/detokenize", json={"tokens": [1], "x": 1}), 400, "x")


def test_new_routes_need_the_key(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    for method, path, body in (
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/v1/models/tiny", None),
    ):
        resp = client.request(method, path, json=body, headers={"Authorization": ""})
        assert resp.status_code == 401, (path, resp.text)


def test_model_by_id(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    resp = client.get("/v1/models/tiny")
    assert resp.status_code == 200 and resp.json()["id"] == "tiny" and resp.json()["object"] == "model"
    assert resp.json() == client.get("/v1/models").json()["data"][0]
    # The components the engine was built with, as in the "model ready" log line.
    assert resp.json()["minisgl"]["attention_backend"] == "torch" and resp.json()["minisgl"]["prefix_cache"] == "radix"
    message = error_of(client.get("/v1/models/no/such-model"), 404, "model")
    assert "'no/such-model' does not exist" in message
    assert client.get("/v1/models/no/such-model").json()["error"]["code"] == "model_not_found"


def test_tokenizer_that_failed_to_load_is_503(tmp_path: Path) -> None:
    def fail() -> Any:
        raise OSError("disk on fire")

    addresses = {name: f"ipc://{tmp_path}/{name}.sock" for name in ("api", "tokenizer-0")}
    settings = ServeSettings(model="/models/tiny")
    app = create_app(settings, addresses, {}, Workers(), text=TextTools(fail))
    with TestClient(app) as client:
        resp = client.post("/tokenize", json={"prompt": "x"})
        assert resp.status_code == 503 and "disk on fire" in resp.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "bogus": 1}).status_code == 400


def test_default_tokenizer_is_the_models(tiny_model: Path, tokenizer: Any, tmp_path: Path) -> None:
    """Without ``text``, the app loads ``--model``'s tokenizer itself (as the launcher's create_app call does)."""
    addresses = {name: f"ipc://{tmp_path}/{name}.sock" for name in ("api", "tokenizer-0")}
    app = create_app(ServeSettings(model=str(tiny_model)), addresses, {"max_model_len": 256}, Workers())
    with TestClient(app) as client:
        out = client.post("/tokenize", json={"model": tiny_model.name, "prompt": "Hello world"}).json()
        assert out == {"count": 2, "max_model_len": 256, "tokens": tokenizer.encode("Hello world")}


# ------------------------------------------------------------------ every value checked, at any depth
def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def with_call(call_id: str = "call_1", arguments: str = '{"city": "Paris"}') -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]


def raw_post(client: TestClient, path: str, body: str, content_type: str | None = "application/json") -> Any:
    headers = {} if content_type is None else {"Content-Type": content_type}
    return client.post(path, content=body.encode(), headers=headers)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        # A lone surrogate anywhere: the escape stays in the JSON text until the body is decoded.
        ('{"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": "\\ud800"}}', "metadata.k", "unpaired"),
        ('{"messages": [{"role": "user", "content": "hi"}], "metadata": {"\\ud800": "v"}}', "metadata", "object key"),
        (
            '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "n\\udc00", "schema": {"type": "object"}}}}',
            "response_format.json_schema.name",
            "unpaired surrogate (U+DC00)",
        ),
        (
            json.dumps({"messages": with_call(call_id="X")}).replace('"X"', '"\\ud800"'),
            "messages[1].tool_calls[0].id",
            "unpaired",
        ),
        (
            json.dumps({"messages": MESSAGES, "tools": [TOOL]}).replace('"city"', '"\\ud800"', 1),
            "tools[0].function.parameters.properties",
            "object key",
        ),
        (
            # Escaped inside the arguments' JSON text: a lone surrogate only once the arguments are decoded.
            json.dumps({"messages": with_call(arguments='{"city": "\\ud800"}')}),
            "messages[1].tool_calls[0]",
            "function.arguments.city (decoded): the string holds an unpaired surrogate",
        ),
        (
            json.dumps({"messages": with_call(arguments='{"a": ' + "[" * 5000 + "]" * 5000 + "}")}),
            "messages[1].tool_calls[0]",
            f"nested deeper than {MAX_JSON_DEPTH} levels",
        ),
        (
            json.dumps({"messages": with_call(arguments=json.dumps({"a": nested(MAX_JSON_DEPTH)}))}),
            "messages[1].tool_calls[0]",
            "function.arguments.a" + "[0]" * (MAX_JSON_DEPTH - 1) + " (decoded): nested deeper",
        ),
        (
            json.dumps({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "object", "default": nested(100)}}}}),
            "response_format.json_schema.schema.default" + "[0]" * (MAX_JSON_DEPTH - 4),
            f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays; flatten it",
        ),
    ],
)  # fmt: skip
def test_every_value_is_checked_at_any_depth(
    api: tuple[TestClient, list[GenerateReq]], body: str, param: str, says: str
) -> None:
    client, submitted = api
    before = len(submitted)
    message = error_of(raw_post(client, "/v1/chat/completions", body), 400, param)
    assert message.startswith(f"{param}: ") and says in message, message
    assert len(submitted) == before


def test_nesting_up_to_the_bound_is_fine(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, submitted = api
    arguments = json.dumps({"a": nested(MAX_JSON_DEPTH - 2)})
    resp = client.post("/v1/chat/completions", json={"messages": with_call(arguments=arguments)})
    assert resp.status_code == 200, resp.text
    assert submitted[-1].messages is not None and submitted[-1].messages[1]["tool_calls"][0]["function"]["arguments"]


def test_a_body_too_deep_to_decode_is_400(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    resp = raw_post(client, "/v1/completions", '{"prompt": "x", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text


@pytest.mark.parametrize(
    ("messages", "extra", "param", "says"),
    [
        (
            [{"role": "tool", "content": "22 C"}],
            {},
            "messages[0].tool_call_id",
            "a tool message needs the tool_call_id",
        ),
        (
            [{"role": "user", "content": "hi", "tool_call_id": "c"}],
            {},
            "messages[0].tool_call_id",
            "only tool messages",
        ),
        (MESSAGES, {"parallel_tool_calls": True}, "parallel_tool_calls", "only allowed when tools are given"),
        (MESSAGES, {"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        (
            MESSAGES,
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
            'the parameters are a JSON schema of "type": "object", got type \'string\'',
        ),
        (
            MESSAGES,
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]},
            "tools[0].function.parameters",
            "got no type",
        ),
    ],
)
def test_refused_as_openai_refuses(
    api: tuple[TestClient, list[GenerateReq]], messages: list[Any], extra: dict[str, Any], param: str, says: str
) -> None:
    client, submitted = api
    before = len(submitted)
    message = error_of(client.post("/v1/chat/completions", json={"messages": messages, **extra}), 400, param)
    assert says in message, message
    assert len(submitted) == before


def test_empty_parameters_take_no_arguments(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    tool = {"type": "function", "function": {"name": "now", "parameters": {}}}
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [tool]}).status_code == 200


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_a_body_that_is_not_json_is_415_naming_its_type(
    api: tuple[TestClient, list[GenerateReq]], content_type: str | None
) -> None:
    client, submitted = api
    before = len(submitted)
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        resp = raw_post(client, path, json.dumps({"messages": MESSAGES, "prompt": "x"}), content_type)
        assert resp.status_code == 415, resp.text
        err = resp.json()["error"]
        assert err["code"] == "unsupported_media_type" and err["param"] is None
        named = f"Content-Type {content_type!r}" if content_type else "without a Content-Type"
        assert named in err["message"] and "send 'Content-Type: application/json'" in err["message"]
    assert len(submitted) == before


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/vnd.x+json"]
)
def test_json_content_types_are_read(api: tuple[TestClient, list[GenerateReq]], content_type: str) -> None:
    client, _ = api
    resp = raw_post(client, "/v1/completions", json.dumps({"prompt": "x"}), content_type)
    assert resp.status_code == 200, resp.text


# ------------------------------------------------------------------ logprobs are JSON numbers
@pytest.fixture
def logprobs() -> Iterator[list[Any]]:
    yield LOGPROBS
    LOGPROBS.clear()


def strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_without_a_probability_are_never_sent_as_infinity(
    api: tuple[TestClient, list[GenerateReq]], logprobs: list[Any]
) -> None:
    """A grammar's forbidden tokens (-inf) are no alternatives; a token with no probability gets the floor."""
    client, _ = api
    logprobs[:] = [["Paris.", float("nan"), [["Paris.", -0.5], ["x", float("-inf")]]]]
    bodies = [
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "regex": "P.*"}),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "regex": "P.*"}),
    ]
    for path, body in bodies:
        for stream in (False, True):
            resp = client.post(path, json={**body, "stream": stream})
            assert resp.status_code == 200, resp.text
            if stream:
                events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
                found = [strict_json(e)["choices"][0]["logprobs"] for e in events[:-1]]
                lp = next(x for x in found if x)
            else:
                lp = strict_json(resp.text)["choices"][0]["logprobs"]
            if "chat" in path:
                entry = lp["content"][0]
                assert entry["logprob"] == LOGPROB_FLOOR
                assert [(a["token"], a["logprob"]) for a in entry["top_logprobs"]] == [("Paris.", -0.5)]
            else:
                assert lp["token_logprobs"] == [LOGPROB_FLOOR] and lp["top_logprobs"] == [{"Paris.": -0.5}]


# ------------------------------------------------------------------ cheap checks before the template
def test_a_conversation_too_long_is_refused_before_it_is_rendered(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = TokenizerService(tokenizer, TokenizerLimits(MAX_LEN, VOCAB))
    rendered: list[int] = []
    template = tokenizer.apply_chat_template

    def counting(*args: Any, **kwargs: Any) -> Any:
        rendered.append(1)
        return template(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    long_text = "word " * (MAX_LEN * service.max_token_chars)
    many = [{"role": "user", "content": ""}] * MAX_LEN
    for messages, says in (
        ([{"role": "user", "content": long_text}], "the prompt has at least"),
        (many, f"the conversation has {MAX_LEN} messages, each at least one token"),
    ):
        req = GenerateReq(1, {"max_tokens": 1}, messages=messages)
        failed = service.tokenize(req)
        assert getattr(failed, "message", "").startswith(says), failed
    assert rendered == []
    ok = service.tokenize(GenerateReq(2, {"max_tokens": 1}, messages=MESSAGES))
    assert getattr(ok, "input_ids", None) and rendered == [1]
