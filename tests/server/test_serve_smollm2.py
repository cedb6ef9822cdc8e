"""The real demo model, SmolLM2-135M-Instruct (GGUF), served with an API key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverutil import Server, openai_client

API_KEY = "test-key-123"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        smollm2_path,
        tmp_path_factory.mktemp("smollm2"),
        "--max-model-len", "512",
        "--num-pages", "128",
        "--served-model-name", "smollm2",
        env={"MINISGL_API_KEY": API_KEY},  # settings come from the environment too
    )  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai_client(server, api_key=API_KEY)


def test_answers_paris(client: Any) -> None:
    out = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=30)
    answer = out.choices[0].message.content
    assert "Paris" in answer
    assert out.choices[0].finish_reason == "stop"  # ended on <|im_end|>, whose text is not in the answer
    assert "<|im_end|>" not in answer


def test_streamed_answer_equals_the_non_streamed_one(client: Any) -> None:
    kwargs: dict[str, Any] = {"model": "smollm2", "messages": FRANCE, "temperature": 0.7, "seed": 11, "max_tokens": 12}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full


def test_completion_with_chat_prompt_text(client: Any) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    out = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=30, stop=["."])
    assert "Paris" in out.choices[0].text
    assert "." not in out.choices[0].text and out.choices[0].finish_reason == "stop"


def test_api_key_is_required_on_v1_routes(server: Server) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai_client(server, api_key="wrong").chat.completions.create(model="smollm2", messages=FRANCE)
    body = {"messages": FRANCE, "max_tokens": 2}
    missing = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["message"].startswith("missing API key")
    assert missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["message"].startswith("incorrect API key")
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_cached_tokens_reported_with_a_prefix_cache(client: Any) -> None:
    from minisgl.plugins import load_plugins

    if "radix" not in load_plugins().names("prefix_cache"):
        pytest.skip("no reusing prefix cache installed (pip install minisgl-plugin-radix)")
    messages = [{"role": "user", "content": "List the planets of the solar system, closest to the sun first."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4)
    again = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4)
    # The whole prompt but its last token can come from the cache, in whole pages.
    assert first.usage.prompt_tokens == again.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
