"""/health follows the workers' heartbeats: a stopped or hung worker turns it red, a busy one does not.

Each worker sends a heartbeat from a thread of its own every half second, also
while its main thread is inside a long engine step; a process that is stopped
(SIGSTOP) or dead falls silent, and the scheduler's heartbeat says how long its
current step has run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverutil import Server

from minisgl.message import Heartbeat
from minisgl.server.launcher import Launcher
from minisgl.server.settings import ServeSettings


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tiny_model,
        tmp_path_factory.mktemp("health"),
        "--num-pages", "80",
        "--max-model-len", "256",
        "--cache", "naive",
        "--health-timeout", "2",
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _health(server: Server) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=10)


def test_health_is_ok_idle_and_busy(server: Server, tiny_model: Path) -> None:
    idle = _health(server)
    assert idle.status_code == 200 and idle.json()["status"] == "ok" and idle.json()["running"] == 0
    body = {"model": tiny_model.name, "prompt": "Go", "max_tokens": 200, "ignore_eos": True, "stream": True}
    seen = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    seen.set()
                    time.sleep(0.01)

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert seen.wait(60)
        busy = _health(server)
        assert busy.status_code == 200, busy.text
    finally:
        worker.join(60)


def test_stopped_scheduler_turns_health_red_until_it_continues(server: Server, tiny_model: Path) -> None:
    pid = server.worker_pids()["scheduler-0"]
    body = {"model": tiny_model.name, "prompt": "Go", "max_tokens": 100, "ignore_eos": True, "stream": True}
    result: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
            result["body"] = "".join(resp.iter_text())

    worker = threading.Thread(target=stream)
    worker.start()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while (resp := _health(server)).status_code == 200:
            assert time.monotonic() < deadline, "a stopped scheduler still looks healthy"
            time.sleep(0.2)
        assert resp.status_code == 503
        assert "scheduler-0 process has not reported" in resp.json()["error"]["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 15
    while _health(server).status_code != 200:
        assert time.monotonic() < deadline, "health did not recover after SIGCONT"
        time.sleep(0.2)
    worker.join(60)
    assert "data: [DONE]" in str(result["body"])  # the request in flight finished normally


def test_health_names_a_stalled_engine_step(tmp_path: Path) -> None:
    launcher = Launcher(ServeSettings(model="unused"), [])
    try:
        now = time.monotonic()
        launcher._beats = {
            "tokenizer-0": (now, Heartbeat("tokenizer-0")),
            "scheduler-0": (now, Heartbeat("scheduler-0", busy_for=3.0, state={"running": 2})),
        }
        report = launcher.health(silence=5.0, stall=10.0)
        assert report.problem is None and report.scheduler == {"running": 2}
        report = launcher.health(silence=5.0, stall=2.0)
        assert report.problem == "the engine has been inside one step for 3 s (stalled)"
        launcher._beats["tokenizer-0"] = (now - 9.0, Heartbeat("tokenizer-0"))
        report = launcher.health(silence=5.0, stall=10.0)
        assert report.problem is not None and report.problem.startswith("the tokenizer-0 process has not reported")
    finally:
        launcher.shutdown()
