"""The parts of ``--dp`` that need no running server: the replicas' devices and memory, the settings it refuses,
and what a replica shows a router (its no-op fields accepted, ``/server_info`` and ``/model_info``)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from minisgl.message import GenerateReq
from minisgl.server.app import create_app
from minisgl.server.launcher import Health
from minisgl.server.replicas import ROUTER_MISSING, ReplicaError, ReplicaSet, check_dp_settings, plan_replicas
from minisgl.server.router_api import ROUTER_NO_OPS, drop_router_no_ops
from minisgl.server.settings import ServeSettings
from minisgl.server.text_tools import TextTools

# What sglang-router 0.3.2 forwards for a client's {"messages": [...], "max_tokens": 4}.
ROUTED = {
    "messages": [{"role": "user", "content": "hi"}], "model": "unknown", "logprobs": False,
    "max_completion_tokens": 4, "stream": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False,
}  # fmt: skip


def test_replicas_get_their_own_gpus_when_there_are_enough() -> None:
    plans = plan_replicas(2, 2, ["0", "1", "2", "3"], 0.85)
    assert [(p.devices, p.mem_fraction, p.wave) for p in plans] == [("0,1", None, 0), ("2,3", None, 0)]
    # CUDA_VISIBLE_DEVICES items are passed on as they are (indices or UUIDs).
    assert [p.devices for p in plan_replicas(2, 1, ["3", "GPU-ab"], 0.9)] == ["3", "GPU-ab"]
    assert [p.devices for p in plan_replicas(3, 1, None, 0.9)] == [None, None, None]  # CPU: a process each
    # On CPU each takes its share of the cores (at least one), so replicas computing at once do not contend.
    assert [p.cpu_threads for p in plan_replicas(2, 1, None, 0.9, cpus=8)] == [4, 4]
    assert [p.cpu_threads for p in plan_replicas(3, 1, None, 0.9, cpus=2)] == [1, 1, 1]
    assert all(p.cpu_threads is None for p in plan_replicas(2, 1, ["0", "1"], 0.9))


@pytest.mark.parametrize(("dp", "fraction"), [(2, 0.85), (3, 0.9), (4, 0.5)])
def test_replicas_sharing_a_gpu_split_its_memory_evenly(dp: int, fraction: float) -> None:
    plans = plan_replicas(dp, 1, ["0"], fraction)
    assert [p.devices for p in plans] == ["0"] * dp and [p.wave for p in plans] == list(range(dp))
    free, taken = 1.0, []
    for plan in plans:  # started one after another, each takes its fraction of what is free then
        assert plan.mem_fraction is not None and plan.mem_fraction <= 1
        taken.append(free * plan.mem_fraction)
        free -= taken[-1]
    assert taken == pytest.approx([fraction / dp] * dp)


def test_more_replicas_than_gpus_are_dealt_round_robin() -> None:
    plans = plan_replicas(4, 1, ["0", "1"], 0.8)
    assert [(p.devices, p.wave) for p in plans] == [("0", 0), ("1", 0), ("0", 1), ("1", 1)]
    assert plans[0].mem_fraction == pytest.approx(0.4) and plans[2].mem_fraction == pytest.approx(0.8 / 1.2)


def test_a_replica_needs_tp_gpus() -> None:
    with pytest.raises(ReplicaError, match=r"--tp 4 needs 4 GPUs per replica, but 2 are visible"):
        plan_replicas(2, 4, ["0", "1"], 0.85)


def test_settings_dp_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ServeSettings(model="m", dp=2, device="cuda:1")
    if importlib.util.find_spec("sglang_router") is not None:
        assert "--device cuda:1 names one GPU" in (check_dp_settings(settings) or "")
        several = check_dp_settings(ServeSettings(model="m", dp=2, nnodes=2, tp=2)) or ""
        assert several.startswith("--dp runs replicas on this host only") and "Multi-host" in several
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "sglang_router" else real(name))
    assert check_dp_settings(ServeSettings(model="m", dp=2)) == ROUTER_MISSING
    assert ROUTER_MISSING == (
        "the --dp router needs sglang-router: pip install 'minisgl[router]' (or: pip install sglang-router)"
    )


def test_router_no_ops_are_dropped_and_nothing_else() -> None:
    body = json.dumps(ROUTED).encode()
    assert json.loads(drop_router_no_ops(body)) == {
        "messages": [{"role": "user", "content": "hi"}], "logprobs": False, "max_completion_tokens": 4,
        "stream": False, "ignore_eos": False, "skip_special_tokens": True,
    }  # fmt: skip
    asked = {**ROUTED, "no_stop_trim": True, "model": "smollm2", "stream_reasoning": 1}
    kept = json.loads(drop_router_no_ops(json.dumps(asked).encode()))
    assert kept["no_stop_trim"] is True and kept["model"] == "smollm2" and kept["stream_reasoning"] == 1
    assert set(ROUTER_NO_OPS) - set(kept) == {"continue_final_message", "separate_reasoning", "return_hidden_states"}
    plain = b'{"messages": [], "model": "unknown"}'  # no router field: left as the client sent it
    assert drop_router_no_ops(plain) == plain
    assert drop_router_no_ops(b'{"no_stop_trim": false') == b'{"no_stop_trim": false'  # bad JSON: the app says so


class Workers:
    tokenizers = ["tokenizer-0"]

    def check(self) -> str | None:
        return None

    def health(self, silence: float, stall: float) -> Health:
        return Health(None, {})


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, list[GenerateReq]]]:
    sockets = tmp_path_factory.mktemp("sock")
    addresses = {name: f"ipc://{sockets}/{name}.sock" for name in ("api", "tokenizer-0")}
    settings = ServeSettings(model="/models/tiny", served_model_name="tiny", max_request_bytes=4096)
    text = TextTools(lambda: None, 64, 100)
    info = {"max_model_len": 64, "vocab_size": 100, "tp": 1, "page_size": 16, "architecture": "LlamaForCausalLM"}
    app = create_app(settings, addresses, info, Workers(), text=text)  # type: ignore[arg-type]
    submitted: list[GenerateReq] = []

    async def submit(req: GenerateReq, sink: Any) -> None:
        submitted.append(req)
        sink.on_output("Paris.", 1, None, ["stop", 3, 0])

    with TestClient(app) as client:
        app.state.client.submit = submit
        yield client, submitted


def test_a_routed_request_is_served_as_the_client_sent_it(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, submitted = api
    resp = client.post("/v1/chat/completions", json=ROUTED)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Paris." and submitted[-1].params["max_tokens"] == 4
    completion = {"model": "tiny", "prompt": "x", "max_tokens": 2, "echo": False, "no_stop_trim": False}
    assert client.post("/v1/completions", json={**completion, "return_hidden_states": False}).status_code == 200
    asked = client.post("/v1/chat/completions", json={**ROUTED, "return_hidden_states": True})
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "return_hidden_states"
    # The size limit still applies before the body is read for the router's fields.
    big = client.post("/v1/chat/completions", json={**ROUTED, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert big.status_code == 413


def test_server_and_model_info(api: tuple[TestClient, list[GenerateReq]]) -> None:
    client, _ = api
    server = client.get("/server_info").json()
    assert server["served_model_name"] == "tiny" and server["tp_size"] == 1 and server["dp_size"] == 1
    assert server["max_model_len"] == 64 and server["page_size"] == 16
    model = client.get("/model_info").json()
    assert model == {
        "served_model_name": "tiny", "is_generation": True, "max_model_len": 64, "vocab_size": 100,
        "architecture": "LlamaForCausalLM",
    }  # fmt: skip


def test_replica_and_router_command_lines() -> None:
    settings = ServeSettings(
        model="m", dp=2, device="cpu", api_key="k", port=30123, router_policy="round_robin",
        router_metrics_port=30124, router_args="--cache-threshold 0.5",
    )  # fmt: skip
    replicas = ReplicaSet(settings, ["--model", "m", "--dp", "2", "--api-key", "k"])
    urls = replicas.worker_urls()
    assert len(urls) == 2 and all(url.startswith("http://127.0.0.1:") for url in urls)
    for replica, url in zip(replicas.replicas, urls, strict=True):
        # The user's flags, then the replica's own: one engine, on loopback (the last of a repeated flag wins).
        serve = replica.command.index("serve")
        assert replica.command[serve + 1 : serve + 7] == ["--model", "m", "--dp", "2", "--api-key", "k"]
        assert replica.command[serve + 7 :] == ["--dp", "1", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]]
        assert replica.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # CPU: as given
        threads = os.environ.get("OMP_NUM_THREADS") or str(replicas.plans[0].cpu_threads)
        assert replica.env["OMP_NUM_THREADS"] == threads  # its share of the cores, unless the user set it
    router = replicas.router.command
    assert router[router.index("--worker-urls") + 1 : router.index("--host")] == urls
    joined = " ".join(router)
    assert "--host 127.0.0.1 --port 30123 --policy round_robin" in joined
    assert "--prometheus-port 30124" in joined and "--api-key k" in joined
    assert router[-2:] == ["--cache-threshold", "0.5"]
    assert replicas.router.url == "http://127.0.0.1:30123/readiness"


class FakeRouter:
    """The worker API of sglang-router on a loopback port: GET/POST /workers, DELETE /workers/ID; records calls."""

    def __init__(self, urls: list[str]):
        import http.server
        import threading

        self.workers = [{"id": f"id-{i}", "url": url} for i, url in enumerate(urls)]
        self.calls: list[tuple[str, str, str | None, Any]] = []  # method, path, Authorization, body
        router = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> Any:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                router.calls.append((self.command, self.path, self.headers.get("Authorization"), body))
                return body

            def do_GET(self) -> None:  # noqa: N802
                self._record()
                self._answer(200, {"workers": router.workers, "total": len(router.workers)})

            def do_DELETE(self) -> None:  # noqa: N802
                self._record()
                router.workers = [w for w in router.workers if f"/workers/{w['id']}" != self.path]
                self._answer(202, {"status": "accepted"})

            def do_POST(self) -> None:  # noqa: N802
                body = self._record()
                router.workers.append({"id": f"id-{len(router.calls)}", "url": body["url"]})
                self._answer(202, {"status": "accepted"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_restarted_replica_leaves_the_router_and_rejoins_it_as_new() -> None:
    """Taken out by id when it exits, added with its URL and the key once it answers again, and never twice."""
    settings = ServeSettings(model="m", dp=2, device="cpu", api_key="k", port=0)
    replicas = ReplicaSet(settings, ["--model", "m"])
    router = FakeRouter(replicas.worker_urls())
    try:
        replicas.settings = settings.model_copy(update={"port": router.port})
        first = replicas.replicas[0]
        url = first.url.removesuffix("/health")
        replicas._router_remove(first)
        assert [w["url"] for w in router.workers] == [replicas.worker_urls()[1]]
        assert [(m, p) for m, p, _, _ in router.calls] == [("GET", "/workers"), ("DELETE", "/workers/id-0")]
        assert all(auth == "Bearer k" for _, _, auth, _ in router.calls)
        assert replicas._router_add(first)
        assert router.calls[-1][0:2] == ("POST", "/workers") and router.calls[-1][3] == {"url": url, "api_key": "k"}
        calls = len(router.calls)
        assert replicas._router_add(first)  # already there (a restarted router registered it): not added twice
        assert [m for m, _, _, _ in router.calls[calls:]] == ["GET"]
        assert sorted(w["url"] for w in router.workers) == sorted(replicas.worker_urls())
    finally:
        router.close()
    # With the router gone, both say so and return (the watch loop tries again).
    assert not replicas._router_add(first)
    replicas._router_remove(first)
