"""``minisgl serve --dp 2``: two replicas of the demo model behind sglang-router, through the official client.

One server for the module (its start is most of the cost); the tests run in file order, the last two kill a replica
and stop the whole server.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverutil import TOOL, Server, alive, descendants, openai_client

KEY = "dp-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install 'minisgl[router]')",
)


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        smollm2_path,
        tmp_path_factory.mktemp("dp"),
        "--dp", "2",
        "--max-model-len", "1024",
        "--num-pages", "192",
        "--max-running-requests", "8",
        "--tokenizer-workers", "1",
        "--served-model-name", "smollm2",
        env={"MINISGL_API_KEY": KEY},
    )  # fmt: skip
    try:
        yield srv.wait_ready(timeout=400, path="/readiness")
    finally:
        srv.stop()


def replicas(server: Server) -> dict[int, tuple[str, int]]:
    """Replica index -> (url, pid), from the supervisor's log (the latest start of each)."""
    found = {int(i): (url, int(pid)) for i, url, pid in re.findall(r"replica (\d+): (\S+) pid=(\d+)", server.log)}
    for name, pid in re.findall(r"replica-(\d+) started again: pid=(\d+)", server.log):
        found[int(name)] = (found[int(name)][0], int(pid))
    return found


def replica_metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def finished(url: str) -> float:
    """Prompt tokens of the requests the replica finished."""
    return replica_metrics(url).get("minisgl_prompt_tokens_total", 0.0)


def healthy_workers(server: Server) -> dict[str, bool]:
    workers = httpx.get(server.url + "/workers", headers=AUTH, timeout=10).json()["workers"]
    return {w["url"]: bool(w["is_healthy"]) for w in workers}


def test_openai_client_flow(server: Server) -> None:
    client = openai_client(server, api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    out = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=12)
    assert "Paris" in out.choices[0].message.content
    # A request without a model, as the router forwards it, is served too.
    body = {"messages": FRANCE, "temperature": 0, "max_tokens": 12}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"] == out.choices[0].message.content
    kwargs: dict[str, Any] = {"model": "smollm2", "messages": FRANCE, "temperature": 0.7, "seed": 5, "max_tokens": 12}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    text = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=30, stop=["."])
    assert "Paris" in text.choices[0].text and text.choices[0].finish_reason == "stop"
    # Tools and a tool-call history pass the router (it re-serialises both) and reach the chat template.
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]  # fmt: skip
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=[TOOL], max_tokens=6)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tools = {"model": "smollm2", "messages": history, "tools": [TOOL], "max_tokens": 1}
    direct = httpx.post(replicas(server)[0][0] + "/v1/chat/completions", json=tools, headers=AUTH, timeout=120)
    assert direct.json()["usage"]["prompt_tokens"] == answer.usage.prompt_tokens  # the same prompt
    # The key is checked at the router.
    refused = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 401


def test_replicas_listen_on_loopback_and_report_health(server: Server) -> None:
    found = replicas(server)
    assert sorted(found) == [0, 1]
    for url, _ in found.values():
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        info = httpx.get(url + "/server_info", headers=AUTH, timeout=10).json()
        assert info["served_model_name"] == "smollm2" and info["dp_size"] == 1
    assert healthy_workers(server) == {url: True for url, _ in found.values()}


def test_abort_on_disconnect_frees_pages_on_its_replica(server: Server) -> None:
    urls = [url for url, _ in replicas(server).values()]
    before = {url: replica_metrics(url).get("minisgl_requests_aborted_total", 0.0) for url in urls}
    body = {"model": "smollm2", "messages": FRANCE, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    deadline = time.monotonic() + 30
    while True:
        after = {url: replica_metrics(url) for url in urls}
        aborted = {url: after[url].get("minisgl_requests_aborted_total", 0.0) - before[url] for url in urls}
        idle = all(m["minisgl_kv_pages_used"] == 0 and m["minisgl_num_requests_running"] == 0 for m in after.values())
        if (sorted(aborted.values()) == [0.0, 1.0] and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(aborted.values()) == [0.0, 1.0], aborted  # the replica that had it ended it
    assert idle, after  # and gave its pages back


def test_follow_up_turns_land_on_the_replica_with_the_prefix(server: Server) -> None:
    from minisgl.plugins import load_plugins

    if "radix" not in load_plugins().names("prefix_cache"):
        pytest.skip("no reusing prefix cache installed (pip install minisgl-plugin-radix)")
    client = openai_client(server, api_key=KEY)
    topics = ["volcanoes", "honey bees", "glaciers", "violins"]
    for topic in topics:
        system = f"You are a patient teacher. Today's lesson is about {topic}. " + "Answer in one short sentence. " * 12
        turn = [{"role": "system", "content": system}, {"role": "user", "content": f"What are {topic}?"}]
        first = client.chat.completions.create(model="smollm2", messages=turn, temperature=0, max_tokens=4)
        turn += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Why?"},
        ]
        second = client.chat.completions.create(model="smollm2", messages=turn, temperature=0, max_tokens=1)
        # The first turn's prompt came from the cache: in whole pages (16 tokens), so all but its last partial page.
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 16, (topic, cached, first.usage.prompt_tokens)


def test_a_hung_replica_is_taken_out_and_rejoins(server: Server) -> None:
    url1, pid1 = replicas(server)[1]
    os.killpg(pid1, signal.SIGSTOP)  # its whole tree: it accepts connections but answers nothing
    try:
        deadline = time.monotonic() + 30
        while healthy_workers(server).get(url1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert healthy_workers(server)[url1] is False
        with httpx.Client(headers=AUTH, timeout=60) as http:
            for n in range(4):
                body = {"model": "smollm2", "prompt": f"{n} is a number.", "max_tokens": 2}
                assert http.post(server.url + "/v1/completions", json=body).status_code == 200
    finally:
        os.killpg(pid1, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not healthy_workers(server).get(url1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert healthy_workers(server)[url1] is True
    assert replicas(server)[1][1] == pid1  # the same process: taken out and put back, not restarted


def test_a_replica_killed_mid_load_leaves_later_requests_answered(server: Server) -> None:
    found = replicas(server)
    url0, pid0 = found[0]
    results: list[tuple[float, int]] = []  # (when sent, status)
    stop = threading.Event()

    def load(seed: int) -> None:
        n = 0
        with httpx.Client(headers=AUTH, timeout=120) as http:
            while not stop.is_set():
                n += 1
                body = {"model": "smollm2", "prompt": f"Count to ten, run {seed}-{n}:", "max_tokens": 4}
                sent = time.monotonic()
                try:
                    status = http.post(server.url + "/v1/completions", json=body).status_code
                except httpx.HTTPError:
                    status = -1
                results.append((sent, status))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        while len(results) < 6:
            time.sleep(0.1)
        killed = time.monotonic()
        os.killpg(pid0, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while healthy_workers(server).get(url0, False) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert healthy_workers(server).get(url0, False) is False  # taken out within seconds
        while sum(1 for sent, _ in results if sent > killed) < 12:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    later = [status for sent, status in results if sent > killed]
    assert later and all(status == 200 for status in later), later
    # It is started again and rejoins: healthy at the router, and given new work.
    deadline = time.monotonic() + 300
    while not healthy_workers(server).get(url0) and time.monotonic() < deadline:
        time.sleep(1)
    assert healthy_workers(server)[url0] is True
    assert replicas(server)[0][1] != pid0

    # It rejoined as a new worker (the router's view of its load and prefixes starts empty, as its cache does):
    # prompts that match no replica's prefixes reach it. Which of four at once go where is the router's choice,
    # so a few rounds are allowed; a replica that is never sent work fails this.
    def ask(n: int) -> int:
        body = {"model": "smollm2", "prompt": f"{n} " * 20, "max_tokens": 16, "ignore_eos": True}
        return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120).status_code

    with ThreadPoolExecutor(4) as pool:
        for first in range(1, 13, 4):
            assert list(pool.map(ask, range(first, first + 4))) == [200] * 4
            if finished(url0) > 0:
                break
    assert finished(url0) > 0


def test_sigterm_stops_every_process(server: Server) -> None:
    tree = descendants(server.proc.pid)
    assert len(tree) >= 7  # router, two replicas with their scheduler, tokenizer and detokenizer
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(90) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in tree if alive(pid)]
