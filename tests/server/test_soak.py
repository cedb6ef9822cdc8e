"""A soak: a few hundred randomized requests against a real server, then its books must balance.

Chat and completions, streaming and not, ``n`` > 1 and several prompts, clients
that leave mid-stream and clients that give up while waiting, on a KV cache
small enough that requests queue. Afterwards: nothing runs or waits, no KV page
is owned by a request, every submitted generation is counted once as finished
or aborted, and the generated-token counter agrees with what clients received.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverutil import Server

REQUESTS = 600
CONCURRENCY = 12
SEED = 20261130


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tiny_model,
        tmp_path_factory.mktemp("soak-server"),
        "--num-pages", "48",  # 768 tokens of KV at page size 16: requests queue and contend
        "--max-model-len", "256",
        "--max-running-requests", "16",
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@dataclass
class Tally:
    """What the clients know for certain, and the bounds where they cannot know."""

    certain_jobs: int = 0  # generations the server surely received
    uncertain_jobs: int = 0  # generations of requests given up before the answer began (maybe never submitted)
    completed_jobs: int = 0  # generations whose whole answer a client read
    completed_tokens: int = 0  # their completion tokens, as the clients' usage says
    left_jobs_max_tokens: int = 0  # the most tokens the generations of left or given-up requests could have made
    errors: list[str] | None = None


def metric_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, labelled ones keyed with their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def finished_total(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith("minisgl_requests_finished_total{"))


def random_request(rng: random.Random) -> tuple[str, dict[str, Any], int]:
    """(path, body, number of generations) of one random valid request."""
    n = rng.choice([1, 1, 1, 2, 3])
    common: dict[str, Any] = {
        "max_tokens": rng.randint(1, 24),
        "n": n,
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "ignore_eos": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        common["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.2:
        common["stop"] = [rng.choice(["the", "\n", "a"])]
    if rng.random() < 0.5:
        words = " ".join(rng.choice(["red", "green", "blue", "tell", "me", "more"]) for _ in range(rng.randint(1, 30)))
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}, n
    prompts: list[Any] = [
        [rng.randint(3, 49000) for _ in range(rng.randint(1, 60))] for _ in range(rng.choice([1, 1, 2, 3]))
    ]
    if rng.random() < 0.3:
        prompts = ["The quick brown fox " * rng.randint(1, 8)]
    return "/v1/completions", {**common, "prompt": prompts}, n * len(prompts)


def record_full(path: str, body: dict[str, Any], jobs: int, resp: httpx.Response, tally: Tally) -> None:
    assert tally.errors is not None
    if resp.status_code != 200:
        tally.errors.append(f"{path} {body} -> {resp.status_code} {resp.text}")
        return
    out = resp.json()
    tally.certain_jobs += jobs
    tally.completed_jobs += jobs
    tally.completed_tokens += out["usage"]["completion_tokens"]
    check_usage(out["choices"], out["usage"]["completion_tokens"], body["max_tokens"], tally)


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    assert tally.errors is not None
    path, body, jobs = random_request(rng)
    kind = rng.choices(["full", "stream", "leave_mid_stream", "give_up_waiting"], [3, 3, 2, 2])[0]
    max_tokens = body["max_tokens"]
    if kind == "full":
        record_full(path, body, jobs, await http.post(path, json=body), tally)
        return
    if kind == "give_up_waiting":
        # The client leaves before any answer: the server may or may not have submitted the generations yet.
        try:
            resp = await asyncio.wait_for(http.post(path, json=body), rng.uniform(0.01, 0.3))
        except TimeoutError:
            tally.uncertain_jobs += jobs
            tally.left_jobs_max_tokens += jobs * max_tokens
            return
        record_full(path, body, jobs, resp, tally)  # it answered in time after all
        return
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    leave_after = rng.randint(1, 4) if kind == "leave_mid_stream" else None
    chunks = 0
    usage: dict[str, Any] | None = None
    finishes: list[dict[str, Any]] = []
    async with http.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            tally.errors.append(f"{path} {body} -> {resp.status_code} {(await resp.aread())!r}")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if chunks == 1:  # sent only once every generation was accepted: from here on they all count
                tally.certain_jobs += jobs
            if leave_after is not None and chunks >= leave_after:
                tally.left_jobs_max_tokens += jobs * max_tokens
                return  # closing the stream here is the client leaving
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            finishes += [c for c in event["choices"] if c.get("finish_reason")]
    # The whole answer was read (also when it ended before the client meant to leave).
    if usage is None:
        tally.errors.append(f"{path} {body}: no usage chunk after {chunks} chunks")
        return
    tally.completed_jobs += jobs
    tally.completed_tokens += usage["completion_tokens"]
    check_usage(finishes, usage["completion_tokens"], max_tokens, tally)


def check_usage(choices: list[dict[str, Any]], completion_tokens: int, max_tokens: int, tally: Tally) -> None:
    """Tokens the usage reports agree with the choices: ``max_tokens`` each where they ended on length."""
    assert tally.errors is not None
    reasons = [c["finish_reason"] for c in choices]
    if any(r not in ("stop", "length") for r in reasons):
        tally.errors.append(f"finish reasons {reasons}")
    if completion_tokens > len(choices) * max_tokens:
        tally.errors.append(f"{completion_tokens} tokens for {len(choices)} choices of at most {max_tokens}")
    if all(r == "length" for r in reasons) and completion_tokens != len(choices) * max_tokens:
        tally.errors.append(f"{completion_tokens} tokens but {len(choices)} choices ended on length {max_tokens}")


def root_cause(exc: BaseException) -> str:
    """The innermost errors behind a transport error (an ExceptionGroup's members too)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    members = getattr(exc, "exceptions", None)
    return repr(exc) if not members else "; ".join(repr(m) for m in members)


async def soak(url: str) -> Tally:
    rng = random.Random(SEED)
    tally = Tally(errors=[])
    queue: asyncio.Queue[random.Random] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(random.Random(rng.random() + i))

    async def worker() -> None:
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            while not queue.empty():
                try:
                    await one_request(http, queue.get_nowait(), tally)
                except httpx.TransportError as exc:
                    assert tally.errors is not None
                    tally.errors.append(f"{exc!r} after {tally.certain_jobs} generations: {root_cause(exc)}")

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return tally


def test_soak_leaves_no_pages_and_balanced_books(server: Server) -> None:
    before = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
    start = time.monotonic()
    tally = asyncio.run(soak(server.url))
    elapsed = time.monotonic() - start
    assert tally.errors == [], "\n".join((tally.errors or [])[:10])

    # Left and given-up requests are aborted within the disconnect check's period; then all is idle.
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(server.url + "/health", timeout=10).json()
        samples = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
        idle = health.get("running") == 0 and health.get("waiting") == 0 and samples["minisgl_kv_pages_used"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert health.get("running") == 0 and health.get("waiting") == 0, health
    assert samples["minisgl_kv_pages_used"] == 0, "KV pages leaked"
    assert samples["minisgl_kv_pages_cached"] <= samples["minisgl_kv_pages_total"]

    finished = finished_total(samples) - finished_total(before)
    aborted = samples["minisgl_requests_aborted_total"] - before.get("minisgl_requests_aborted_total", 0)
    generated = samples["minisgl_generation_tokens_total"] - before.get("minisgl_generation_tokens_total", 0)
    summary = f"{tally} finished={finished} aborted={aborted} generated={generated} in {elapsed:.0f}s"
    print(summary)
    # Every generation the server received ends exactly once, finished or aborted.
    assert tally.certain_jobs <= finished + aborted <= tally.certain_jobs + tally.uncertain_jobs, summary
    assert finished >= tally.completed_jobs, summary
    assert aborted > 0, summary  # the soak did make clients leave
    # Generated tokens: all those clients read in full, plus at most what left requests could have made.
    assert tally.completed_tokens <= generated <= tally.completed_tokens + tally.left_jobs_max_tokens, summary

    # And the server still answers correctly.
    out = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
