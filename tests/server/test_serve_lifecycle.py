"""Process lifecycle of ``minisgl serve``: signals, crashed workers, start-up failures."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverutil import Server, alive, child_pids, descendants


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def start(tiny_model: Path, tmp_path: Path, *args: str) -> Server:
    return Server(tiny_model, tmp_path, "--num-pages", "64", "--max-model-len", "256", *args).wait_ready()


def stream_in_background(server: Server, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """POST ``body`` in a thread; the result dict gets "status", "text" (the raw body) or "error"."""
    result: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
                result["status"] = resp.status_code
                chunks = []
                for chunk in resp.iter_text():
                    chunks.append(chunk)
                    started.set()
                result["text"] = "".join(chunks)
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60)
    return thread, result


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_requests_and_leaves_nothing_behind(tiny_model: Path, tmp_path: Path, signum: int) -> None:
    # A grace period long enough for the request in flight to finish even on a loaded machine.
    server = start(tiny_model, tmp_path, "--shutdown-timeout", "60")
    try:
        workers = server.worker_pids()
        assert set(workers) == {"scheduler-0", "tokenizer-0", "detokenizer"}
        assert set(workers.values()) <= set(child_pids(server.proc.pid))
        children = child_pids(server.proc.pid)
        sockets = list(server.tmpdir.iterdir())
        assert len(sockets) == 1 and sockets[0].name.startswith("minisgl-")
        names = {p.name for p in sockets[0].iterdir()}
        assert names >= {"scheduler.sock", "tokenizer-0.sock", "detokenizer.sock", "api.sock"}
        body = {"prompt": "in flight", "max_tokens": 200, "ignore_eos": True, "stream": True}
        thread, result = stream_in_background(server, body)
        server.proc.send_signal(signum)
        assert server.wait_exit(90) == 0, server.log
        thread.join(30)
        assert not thread.is_alive()  # the in-flight request ended
        assert result.get("status") == 200
        assert result["text"].endswith("data: [DONE]\n\n")  # it finished within the grace period
        assert '"finish_reason":"length"' in result["text"]
        assert wait_gone(children) == []
        assert list(server.tmpdir.iterdir()) == []  # the socket directory is removed
        assert "Traceback" not in server.log
    finally:
        server.stop()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_ends_what_outlasts_the_grace_period_with_an_error(
    tiny_model: Path, tmp_path: Path, signum: int
) -> None:
    server = Server(
        tiny_model, tmp_path, "--num-pages", "160", "--max-model-len", "1024", "--shutdown-timeout", "0.5"
    ).wait_ready()
    try:
        long = {"prompt": "in flight", "max_tokens": 1000, "ignore_eos": True}
        thread, streamed = stream_in_background(server, {**long, "stream": True})
        plain: dict[str, Any] = {}

        def post() -> None:
            resp = httpx.post(server.url + "/v1/completions", json=long, timeout=60)
            plain.update(status=resp.status_code, body=resp.json())

        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health", timeout=10).json().get("running") != 2:  # both in flight
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signum)
        # New requests are refused while the old ones drain.
        assert server.wait_exit(60) == 0, server.log
        thread.join(30)
        poster.join(30)
        assert streamed["status"] == 200
        events = [e for e in streamed["text"].split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["message"].endswith("the server is shutting down")
        assert plain["status"] == 503 and "shutting down" in plain["body"]["error"]["message"]
        log = server.log
        assert "Traceback" not in log, log
        assert log.count("ending 2 requests still running after 0.5 s") == 1, log
    finally:
        server.stop()


def test_killed_scheduler_gives_503_and_the_server_exits(tiny_model: Path, tmp_path: Path) -> None:
    server = start(tiny_model, tmp_path)
    try:
        children = child_pids(server.proc.pid)
        body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True}
        result: dict[str, Any] = {}

        def run() -> None:
            resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            result["status"], result["body"] = resp.status_code, resp.json()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while server.metrics()["minisgl_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        streaming, streamed = stream_in_background(server, {**body, "stream": True})
        os.kill(server.worker_pids()["scheduler-0"], signal.SIGKILL)
        thread.join(60)
        streaming.join(60)
        # A stream already under way ends with an error event (its status line was sent long ago).
        assert streamed["status"] == 200
        assert '"code":"service_unavailable"' in streamed["text"] and streamed["text"].endswith("data: [DONE]\n\n")
        assert result["status"] == 503, result
        assert "scheduler-0" in result["body"]["error"]["message"]
        assert "signal 9" in result["body"]["error"]["message"]
        assert server.wait_exit(60) == 1
        assert "scheduler-0 process was killed by signal 9" in server.log
        assert wait_gone(children) == []
        assert list(server.tmpdir.iterdir()) == []
    finally:
        server.stop()


def test_start_up_failure_in_a_worker_exits_with_its_error(tiny_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad-model"
    bad.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    for f in tiny_model.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    server = Server(bad, tmp_path)
    try:
        code = server.wait_exit(180)
        assert code != 0
        assert "scheduler-0 process failed to start" in server.log
        assert "unknown model architecture 'NoSuchForCausalLM'" in server.log
        assert list(server.tmpdir.iterdir()) == []
    finally:
        server.stop()


def test_out_of_memory_at_start_up_is_reported(tiny_model: Path, tmp_path: Path) -> None:
    # A KV cache far larger than the machine: the scheduler cannot allocate it.
    server = Server(tiny_model, tmp_path, "--num-pages", str(1 << 40))
    try:
        assert server.wait_exit(180) != 0
        assert "scheduler-0 process failed to start: out of memory" in server.log
        assert list(server.tmpdir.iterdir()) == []
    finally:
        server.stop()


def test_tensor_parallel_server(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from minisgl.testing.models import hf_greedy

    server = start(tiny_model, tmp_path, "--tp", "2")
    try:
        workers = server.worker_pids()
        procs = descendants(server.proc.pid)
        assert child_pids(workers["scheduler-0"]), "rank 1 runs as a child of the scheduler process"
        assert "[rank 1] " in server.log  # the second rank logs with its rank
        prompt = [9, 99, 999, 9999, 5]
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        from transformers import AutoTokenizer

        expected = AutoTokenizer.from_pretrained(tiny_model).decode(hf_greedy(hf, [prompt], 10)[0])
        assert out["choices"][0]["text"] == expected
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log
        assert wait_gone(procs) == []  # the second rank too
        assert list(server.tmpdir.iterdir()) == []
    finally:
        server.stop()


def _tiny_expected(tiny_model: Path, prompt: list[int], n: int) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from minisgl.testing.models import hf_greedy

    hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(tiny_model).decode(hf_greedy(hf, [prompt], n)[0])


def test_two_node_server_on_loopback(tiny_model: Path, tmp_path: Path) -> None:
    """--nnodes 2, one rank each: node 1 runs `serve --node-rank 1` (ranks only), node 0 the API."""
    import subprocess
    import sys

    from serverutil import free_port

    addr = f"127.0.0.1:{free_port()}"
    multi = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1_log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "serve", "--model", str(tiny_model), "--num-pages", "64",
         "--max-model-len", "256", *multi, "--node-rank", "1"],
        stdout=node1_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = None
    try:
        server = start(tiny_model, tmp_path, *multi, "--node-rank", "0")
        prompt = [9, 99, 999, 9999, 5]
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert out["choices"][0]["text"] == _tiny_expected(tiny_model, prompt, 10)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log
        assert node1.wait(60) == 0, (tmp_path / "node1.log").read_text()  # rank 0 told it to stop
    finally:
        if server is not None:
            server.stop()
        node1.kill()
        node1_log.close()


def test_killed_rank_makes_the_server_exit(tiny_model: Path, tmp_path: Path) -> None:
    server = start(tiny_model, tmp_path, "--tp", "2")
    try:
        workers = server.worker_pids()
        procs = descendants(server.proc.pid)
        (rank1,) = child_pids(workers["scheduler-0"])
        os.kill(rank1, signal.SIGKILL)
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 503
        assert server.wait_exit(60) != 0
        assert "tensor-parallel minisgl-tp-rank1 exited" in server.log
        assert wait_gone(procs) == []
        assert list(server.tmpdir.iterdir()) == []
    finally:
        server.stop()
