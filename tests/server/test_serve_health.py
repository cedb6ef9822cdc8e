"""/health tells a scheduler that is busy with a long step from one that does not answer.

``--health-timeout`` is set so short that the scheduler can never answer in time: with no
request in flight that is "not ready" (503); with one streaming, it is "busy" (200).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverutil import Server


@pytest.fixture(scope="module")
def impatient_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tiny_model,
        tmp_path_factory.mktemp("impatient"),
        "--num-pages", "80",
        "--max-model-len", "256",
        "--cache", "naive",
        "--health-timeout", "1e-9",
    )  # fmt: skip
    try:
        # /health cannot say 200 while idle here: wait on /v1/models instead.
        yield server.wait_ready(path="/v1/models")
    finally:
        server.stop()


def test_health_is_busy_while_requests_run_and_unavailable_when_idle(impatient_server: Server, tiny_model: Path):
    url = impatient_server.url
    idle = httpx.get(url + "/health", timeout=10)
    assert idle.status_code == 503
    assert "did not answer within 1e-09 s" in idle.json()["error"]["message"]

    first_chunk = threading.Event()
    done = threading.Event()
    body = {"model": tiny_model.name, "prompt": "Go", "max_tokens": 240, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    first_chunk.set()
                    time.sleep(0.01)  # read slowly: the request stays in flight for a while
        done.set()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert first_chunk.wait(60)
        busy = httpx.get(url + "/health", timeout=10)
        assert busy.status_code == 200, busy.text
        assert busy.json()["status"] == "busy" and busy.json()["in_flight"] == 1
    finally:
        worker.join(60)
    assert done.is_set()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health", timeout=10).status_code != 503:  # finished: idle again
        assert time.monotonic() < deadline
        time.sleep(0.1)
