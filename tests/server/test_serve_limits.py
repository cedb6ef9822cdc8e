"""Request limits of a real server: valid Unicode, strict types, bounded stop strings, prompts and choices,
the body size (refused before it is read), and the API key (checked before the body, on /docs too)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverutil import Server

API_KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMIT = 2 * 2**20  # the default --max-request-bytes
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tiny_model,
        tmp_path_factory.mktemp("limits-server"),
        "--api-key", API_KEY,
        "--num-pages", "400",
        "--max-model-len", "1024",
        "--cache", "naive",
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def post_raw(server: Server, path: str, body: str | bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=data, headers=headers, timeout=120)


def assert_error(resp: httpx.Response, status: int, param: str | None, *fragments: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for f in fragments:
        assert f in err["message"], err["message"]
    return err


def status_kib(pid: int, field: str) -> int:
    """A size from /proc/PID/status, e.g. VmRSS (resident now) or VmHWM (its peak), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def reset_peak(pid: int) -> bool:
    """Reset the peak resident size (VmHWM) of ``pid`` to its current one; False where /proc does not allow it."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def raw_exchange(server: Server, head: str, parts: list[bytes], timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    """Send a request head and some body parts, never the rest; the status and JSON of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        for part in parts:
            sock.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before an answer: {data!r}"
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(fields["content-length"])
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk
            rest += chunk
        return int(lines[0].split()[1]), json.loads(rest[:length])


# ------------------------------------------------------------------ lone surrogates
SURROGATE_CASES = [
    (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages[0].content[0].text",
    ),
    (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": "a\\ud800"}]}', "messages[0].name"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": "x\\ud800"}', "stop"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\ud800"]}', "stop[1]"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', "model"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "user": "\\udc00"}', "user"),
    (COMPLETIONS, '{"prompt": "a\\ud800b"}', "prompt"),
    (COMPLETIONS, '{"prompt": ["fine", "a\\ud800b"]}', "prompt[1]"),
    (COMPLETIONS, '{"prompt": "a", "stop": ["\\ud800"]}', "stop[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES)
def test_a_lone_surrogate_is_400_naming_the_field(server: Server, path: str, body: str, param: str) -> None:
    for stream in (False, True):
        streamed = body[:-1] + ', "stream": true}' if stream else body
        assert_error(post_raw(server, path, streamed), 400, param, "unpaired surrogate", "valid Unicode")


def test_a_surrogate_pair_is_one_character_and_fine(server: Server) -> None:
    body = '{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], "max_tokens": 2}'
    assert post_raw(server, CHAT, body).status_code == 200


# ------------------------------------------------------------------ strict types
@pytest.mark.parametrize(
    ("path", "extra", "param", "fragment"),
    [
        (CHAT, {"max_tokens": "4"}, "max_tokens", "valid integer"),
        (CHAT, {"max_tokens": 4.0}, "max_tokens", "valid integer"),
        (CHAT, {"stream": "yes"}, "stream", "valid boolean"),
        (CHAT, {"stream": 1}, "stream", "valid boolean"),
        (CHAT, {"temperature": "0.5"}, "temperature", "valid number"),
        (CHAT, {"n": "2"}, "n", "valid integer"),
        (CHAT, {"logprobs": "true"}, "logprobs", "valid boolean"),
        (CHAT, {"stream_options": {"include_usage": "true"}}, "stream_options.include_usage", "valid boolean"),
        (CHAT, {"seed": "7"}, "seed", "valid integer"),
        (COMPLETIONS, {"logprobs": True}, "logprobs", "valid integer"),
        (COMPLETIONS, {"echo": "false"}, "echo", "valid boolean"),
        (COMPLETIONS, {"stop_token_ids": ["2"]}, "stop_token_ids[0]", "valid integer"),
    ],
)
def test_wrong_types_are_400_not_coerced(
    server: Server, path: str, extra: dict[str, Any], param: str, fragment: str
) -> None:
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    assert_error(post_raw(server, path, json.dumps({**base, **extra})), 400, param, fragment)


def test_an_integer_is_a_valid_float(server: Server) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1, "frequency_penalty": 0}
    resp = post_raw(server, COMPLETIONS, json.dumps(body))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ stop strings, prompts, choices
def test_stop_strings_are_bounded_in_number_and_length(server: Server) -> None:
    base = {"prompt": "hi", "max_tokens": 2}
    resp = post_raw(server, COMPLETIONS, json.dumps({**base, "stop": ["a", "b", "c", "d", "e"]}))
    assert_error(resp, 400, "stop", "at most 4 stop strings, got 5")
    resp = post_raw(server, COMPLETIONS, json.dumps({**base, "stop": "x" * 129}))
    assert_error(resp, 400, "stop", "at most 128 characters, got one of 129")
    ok = post_raw(server, COMPLETIONS, json.dumps({**base, "stop": ["w" * 128, "x", "y", "z"]}))
    assert ok.status_code == 200, ok.text


def test_prompts_and_choices_per_request_are_capped(server: Server) -> None:
    resp = post_raw(server, COMPLETIONS, json.dumps({"prompt": ["hi"] * 1000, "n": 16, "max_tokens": 1}))
    assert_error(resp, 400, "prompt", "at most 32 prompts per request (--max-prompts), got 1000")
    resp = post_raw(server, CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 17}))
    assert_error(resp, 400, "n", "at most 16 choices per prompt (--max-n), got 17")
    resp = post_raw(server, COMPLETIONS, json.dumps({"prompt": "hi", "n": 129}))
    assert_error(resp, 400, "n", "less than or equal to 128")
    ok = post_raw(server, COMPLETIONS, json.dumps({"prompt": [[5, 6]] * 32, "max_tokens": 1}))
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 32
    assert server.metrics()["minisgl_kv_pages_used"] == 0


# ------------------------------------------------------------------ body size and API key before the body
def test_a_big_body_is_413_at_once_in_openai_shape(server: Server) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "a" * 12_000_000}]})
    start = time.monotonic()
    resp = post_raw(server, CHAT, body)
    assert time.monotonic() - start < 5
    err = assert_error(resp, 413, None, "12,000,0", "--max-request-bytes", f"{LIMIT:,}")
    assert err["code"] == "request_too_large"
    # Just under the limit is parsed as usual (here: a prompt longer than the context).
    fits = json.dumps({"prompt": "word " * ((LIMIT - 100) // 5)})
    assert_error(post_raw(server, COMPLETIONS, fits), 400, "prompt", "context length")


def test_an_oversized_declared_body_is_refused_unread(server: Server) -> None:
    """Only 64 KiB of a declared 80 MB is ever sent: the answer must come without the rest."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 80000000\r\n\r\n"
    )
    status, body = raw_exchange(server, head, [b"{" + b" " * 65535])
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # Without the key: 401, also before the body.
    status, body = raw_exchange(server, head.replace(f"Bearer {API_KEY}", "Bearer wrong"), [b" " * 65536])
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    head_no_key = head.replace(f"Authorization: Bearer {API_KEY}\r\n", "")
    status, body = raw_exchange(server, head_no_key, [b" " * 65536])
    assert status == 401 and body["error"]["message"].startswith("missing API key")


def test_a_chunked_body_is_counted_as_it_arrives(server: Server) -> None:
    """No Content-Length: the body is refused once it passes the limit, without waiting for its end."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b" " * 65536
    parts = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * (LIMIT // len(chunk) + 2)  # no last chunk
    status, body = raw_exchange(server, head, parts)
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]


def test_a_refused_body_is_never_buffered(server: Server) -> None:
    pid = server.proc.pid
    # Once ready, the API process still loads its own tokenizer (for /tokenize) in the background, 100-200 MiB:
    # wait for it (/tokenize answers after it), so that what is measured is the refused bodies alone.
    assert post_raw(server, "/tokenize", json.dumps({"prompt": "hi"})).status_code == 200
    before = status_kib(pid, "VmRSS")
    peak = "VmHWM" if reset_peak(pid) else "VmRSS"  # the peak, where the kernel lets it be reset; else the end
    for headers in (AUTH, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(server.url + CHAT, content=b" " * 80_000_000, headers=headers, timeout=120)
        assert resp.status_code in (401, 413), resp.text
    growth_mib = (status_kib(pid, peak) - before) / 1024
    assert growth_mib < 40, f"the API process grew by {growth_mib:.0f} MiB ({peak}) for refused 80 MB bodies"


def test_a_big_body_does_not_stall_a_concurrent_stream(server: Server) -> None:
    arrivals: list[float] = []
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "stream": True, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", server.url + COMPLETIONS, json=body, headers=AUTH, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(arrivals) >= 20, "the stream did not start"
    start = time.monotonic()
    big = json.dumps({"messages": [{"role": "user", "content": "hello " * 2_000_000}]})  # 12 MB
    status = post_raw(server, CHAT, big).status_code
    refused = time.monotonic()
    count_at_refusal = len(arrivals)
    reader.join(120)
    assert status == 413
    assert refused - start < 2.0
    during = [t for t in arrivals if t >= start - 0.5]
    gaps = [b - a for a, b in zip(during, during[1:]) if a <= refused]
    assert gaps and max(gaps) < 1.0, f"the stream paused for {max(gaps):.1f} s"
    assert len(arrivals) > count_at_refusal, "the stream had ended before the refusal: nothing was shown"


# ------------------------------------------------------------------ the key on every route but /health and /metrics
@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/v1/models", "/v1/nothing"])
def test_docs_and_every_api_route_need_the_key(server: Server, path: str) -> None:
    resp = httpx.get(server.url + path, timeout=10)
    err = assert_error(resp, 401, None, "missing API key")
    assert err["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
    expected = 404 if path == "/v1/nothing" else 200
    assert httpx.get(server.url + path, headers=AUTH, timeout=10).status_code == expected


def test_health_and_metrics_stay_open(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
