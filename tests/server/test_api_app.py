"""The FastAPI app without a model or workers: a fake engine answers every job, a real tokenizer tokenizes.

Covers what the app decides by itself: refusals of unsupported fields and unknown arguments,
``/tokenize`` and ``/detokenize``, ``GET /v1/models/{id}`` and the API key on the new routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from minisgl.message import GenerateReq
from minisgl.server.app import create_app
from minisgl.server.launcher import Health
from minisgl.server.settings import ServeSettings
from minisgl.server.text_tools import TextTools

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 64
VOCAB = 49152
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


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
    app = create_app(settings, addresses, {"max_model_len": MAX_LEN, "vocab_size": VOCAB}, Workers(), text=text)
    submitted: list[GenerateReq] = []

    async def submit(req: GenerateReq, sink: Any) -> None:  # the fake engine: one word, then stop
        submitted.append(req)
        sink.on_output("Paris.", 2, None, ["stop", 7, 0])

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
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "not supported yet"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool"),
        ("/v1/chat/completions", {"logit_bias": {"5": 10}}, "logit_bias", "leave it out"),
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


def test_tool_calls_in_messages_are_refused(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msgs = [*MESSAGES, {"role": "assistant", "tool_calls": calls}]
    resp = client.post("/v1/chat/completions", json={"messages": msgs})
    assert "tool calling" in error_of(resp, 400, "messages[1].tool_calls")


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
