"""The OpenAI API of a real ``minisgl serve`` process on a tiny random model, driven by the openai client."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serverutil import Server, async_openai_client, openai_client
from transformers import AutoTokenizer, LlamaForCausalLM

from minisgl.testing.models import hf_greedy

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> Any:
    return openai_client(tiny_server)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_models_lists_the_served_model(client: Any, tiny_model: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_model.name]


def test_greedy_completion_matches_transformers(client: Any, tiny_model: Path, tokenizer: Any) -> None:
    prompt = [5, 400, 1234, 9876, 42, 17]
    out = client.completions.create(
        model=tiny_model.name, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    expected = hf_greedy(hf, [prompt], 12)[0]
    assert out.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 12


def test_chat_stream_equals_non_stream_for_the_same_seed(client: Any, tiny_model: Path, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": tiny_model.name, "messages": MESSAGES, "max_tokens": 20, "seed": 123}
    full = client.chat.completions.create(**kwargs, temperature=1.0)
    chunks = list(
        client.chat.completions.create(**kwargs, temperature=1.0, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    # The prompt is the chat template applied to the messages, tokenized.
    assert full.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))
    # Another seed samples something else (20 tokens from a 49k vocabulary at temperature 1).
    other = client.chat.completions.create(**{**kwargs, "seed": 124}, temperature=1.0)
    assert other.choices[0].message.content != full.choices[0].message.content


def test_completion_stream_equals_non_stream(client: Any, tiny_model: Path, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": tiny_model.name, "prompt": "The quick brown fox", "max_tokens": 16, "seed": 5}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert full.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))
    assert full.usage.prompt_tokens_details.cached_tokens == 0  # --cache naive: nothing is reused
    n_tokens = full.usage.completion_tokens
    assert full.choices[0].finish_reason == ("length" if n_tokens == 16 else "stop")


def test_max_completion_tokens_and_usage(client: Any, tiny_model: Path) -> None:
    no_eos = {"ignore_eos": True}
    out = client.chat.completions.create(
        model=tiny_model.name, messages=MESSAGES, max_completion_tokens=7, temperature=0, extra_body=no_eos
    )
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.choices[0].finish_reason == "length"


def test_several_prompts_and_n(client: Any, tiny_model: Path) -> None:
    prompts = ["one two", "three four five"]
    out = client.completions.create(model=tiny_model.name, prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the n choices agree
    singles = [client.completions.create(model=tiny_model.name, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    assert [texts[0], texts[2]] == [s.choices[0].text for s in singles]
    # A prompt shared by n choices counts once.
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == sum(c.usage.completion_tokens for c in singles) * 2


def test_token_id_list_prompts(client: Any, tiny_model: Path) -> None:
    out = client.completions.create(model=tiny_model.name, prompt=[[7, 8, 9], [10, 11]], max_tokens=3, temperature=0)
    assert len(out.choices) == 2
    assert out.usage.prompt_tokens == 5


def test_stop_string_cuts_the_text(client: Any, tiny_model: Path) -> None:
    base = dict(model=tiny_model.name, prompt="Once upon a time", max_tokens=24, temperature=0)
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = full[: full.index(stop)]
    out = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**base, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_stop_token_ids(client: Any, tiny_model: Path, tokenizer: Any) -> None:
    prompt = [11, 22, 33, 44]
    base: dict[str, Any] = dict(model=tiny_model.name, prompt=prompt, max_tokens=10, temperature=0)
    hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = hf_greedy(hf, [prompt], 10)[0]
    target = ids[3]
    first = ids.index(target)  # the stop token may already appear earlier
    out = client.completions.create(**base, extra_body={"stop_token_ids": [target], "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == first + 1
    assert out.choices[0].text == tokenizer.decode(ids[:first], skip_special_tokens=True)


def test_logprobs(client: Any, tiny_model: Path) -> None:
    out = client.completions.create(model=tiny_model.name, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    chat = client.chat.completions.create(
        model=tiny_model.name, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_penalties_and_sampling_options_are_accepted(client: Any, tiny_model: Path) -> None:
    out = client.chat.completions.create(
        model=tiny_model.name,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    assert out.usage.completion_tokens >= 1


def test_32_concurrent_streams(tiny_server: Server, client: Any, tiny_model: Path) -> None:
    prompts = [f"Story number {i}:" for i in range(4)]
    expected = [
        client.completions.create(model=tiny_model.name, prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in prompts
    ]

    async def one(aclient: Any, i: int) -> str:
        stream = await aclient.completions.create(
            model=tiny_model.name, prompt=prompts[i % 4], max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> list[str]:
        aclient = async_openai_client(tiny_server)
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    texts = asyncio.run(run())
    assert texts == [expected[i % 4] for i in range(32)]
    assert tiny_server.settled_metrics()["minisgl_kv_pages_used"] == 0


def test_disconnect_aborts_and_frees_pages(tiny_server: Server, tiny_model: Path) -> None:
    before = tiny_server.metrics()
    # The most tokens the context allows: a warm server decodes them in a few hundred milliseconds, so the client
    # leaves right after the first chunks (waiting for the gauges, which follow a 0.5 s heartbeat, could outlast it).
    body = {"model": tiny_model.name, "prompt": "Go on forever", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: {") or line == "" for line in got)
    # The connection is closed mid-stream: the request is aborted and its pages come back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = tiny_server.metrics()
        if after["minisgl_kv_pages_used"] == 0 and after["minisgl_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert after["minisgl_kv_pages_used"] == 0
    assert after["minisgl_num_requests_running"] == 0
    assert after["minisgl_requests_aborted_total"] == before["minisgl_requests_aborted_total"] + 1
    assert after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"] < 240


def test_non_streaming_client_that_leaves_is_aborted(tiny_server: Server, tiny_model: Path) -> None:
    before = tiny_server.metrics()
    body = {"model": tiny_model.name, "prompt": "Go", "max_tokens": 250, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = tiny_server.metrics()
        aborted = after["minisgl_requests_aborted_total"] > before["minisgl_requests_aborted_total"]
        if aborted and after["minisgl_kv_pages_used"] == 0 and after["minisgl_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert after["minisgl_requests_aborted_total"] == before["minisgl_requests_aborted_total"] + 1
    assert after["minisgl_kv_pages_used"] == 0 and after["minisgl_num_requests_running"] == 0
    assert after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"] < 250


def test_metrics_count_tokens(tiny_server: Server, client: Any, tiny_model: Path) -> None:
    before = tiny_server.metrics()
    out = client.completions.create(model=tiny_model.name, prompt="Counting tokens", max_tokens=5, temperature=0)
    after = tiny_server.metrics()
    assert after["minisgl_prompt_tokens_total"] - before["minisgl_prompt_tokens_total"] == out.usage.prompt_tokens
    generated = after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
    assert generated == out.usage.completion_tokens
    assert after["minisgl_time_to_first_token_seconds_count"] == before["minisgl_time_to_first_token_seconds_count"] + 1
    assert after["minisgl_kv_pages_total"] == 159
    idle = tiny_server.settled_metrics()
    assert idle["minisgl_kv_pages_reserved"] == 0 and idle["minisgl_preemptions_total"] == 0
    assert idle["minisgl_kv_pages_free"] + idle["minisgl_kv_pages_cached"] == idle["minisgl_kv_pages_total"]
    text = httpx.get(tiny_server.url + "/metrics").text
    assert "minisgl_inter_token_latency_seconds_bucket" in text
    assert 'minisgl_kv_cache_info{dtype="float32"} 1.0' in text  # what the KV cache stores (CPU: the model dtype)
    card = httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["minisgl"]
    assert card["kv_cache_dtype"] == "float32" and card["kv_pages"] == 159


# ------------------------------------------------------------------ errors
def post(server: Server, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    if isinstance(body, (str, bytes)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, **kwargs)
    return httpx.post(server.url + path, json=body, **kwargs)


def assert_error(resp: httpx.Response, status: int, param: str | None, *fragments: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    for f in fragments:
        assert f in err["message"], err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 3}, "temperature", "less than or equal to 2"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature", "valid number"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, "n", "greater than or equal to 1"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 50}, "top_logprobs", "less than or equal"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        ("/v1/chat/completions", {}, "messages", "required"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, "stop", "non-empty"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ("/v1/completions", {"prompt": []}, "prompt", "the prompt list is empty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 9}, "frequency_penalty", "less than or equal to 2"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo", "not supported"),
        ("/v1/completions", {"prompt": [999999]}, "prompt", "outside the vocabulary"),
        ("/v1/completions", {"prompt": [[1], [-4]]}, "prompt", "token id -4 is not a valid token id"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed", "less than or equal to"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2**40}, "max_tokens", "less than or equal to"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids", "below 2**31"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    tiny_server: Server, path: str, body: dict[str, Any], param: str, fragment: str
) -> None:
    assert_error(post(tiny_server, path, body), 400, param, fragment)


def test_malformed_json_is_400(tiny_server: Server) -> None:
    assert_error(post(tiny_server, "/v1/chat/completions", b'{"messages": [}'), 400, None, "not valid JSON")
    assert_error(post(tiny_server, "/v1/completions", b"[1, 2]"), 400, None, "JSON object")


def test_prompt_longer_than_context_is_400_with_both_lengths(tiny_server: Server) -> None:
    resp = post(tiny_server, "/v1/completions", {"prompt": list(range(10, 310)), "max_tokens": 4})
    assert_error(resp, 400, "prompt", "300 tokens", "context length is 256")
    resp = post(tiny_server, "/v1/completions", {"prompt": [10, 11], "max_tokens": 300})
    assert_error(resp, 400, "max_tokens", "302", "256")
    # The same for a streaming request: refused before the stream starts.
    long_chat = [{"role": "user", "content": "word " * 400}]
    resp = post(tiny_server, "/v1/chat/completions", {"messages": long_chat, "stream": True})
    assert_error(resp, 400, "messages", "context length is 256")


def test_unknown_model_is_404(tiny_server: Server, client: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert "no-such-model" in str(info.value)
    assert_error(post(tiny_server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model", "'gpt-4'")


def test_tokenize_matches_the_prompt_the_engine_counts(tiny_server: Server, client: Any, tiny_model: Path) -> None:
    """/tokenize (the API process's own tokenizer) counts the tokens a chat request's usage reports."""
    tokens = post(tiny_server, "/tokenize", {"model": tiny_model.name, "messages": MESSAGES}).json()
    reply = client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, max_tokens=1)
    assert tokens["count"] == reply.usage.prompt_tokens == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256
    text = post(tiny_server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert "Name three colours." in text
    # Unknown arguments are refused, as OpenAI refuses them; the official client sends only known ones.
    import openai

    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: best_guess"):
        client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, extra_body={"best_guess": 1})


def test_unknown_route_is_404_in_openai_shape(tiny_server: Server) -> None:
    assert_error(httpx.get(tiny_server.url + "/v1/nothing"), 404, None, "Not Found")


def test_server_still_healthy_after_errors(tiny_server: Server) -> None:
    resp = httpx.get(tiny_server.url + "/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    assert tiny_server.settled_metrics()["minisgl_kv_pages_used"] == 0
