"""The API server's side of the ZMQ links: submit requests, route outputs back to them, count them.

A request goes to the least busy tokenizer worker (fewest requests whose first output has not come back); its
abort follows it through the same worker, so it can never overtake it. One reader task hands each output of an
:class:`~minisgl.message.OutputBatch` to the :class:`Sink` of its request without allocating anything per token.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Protocol

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..message import AbortReq, GenerateReq, OutputBatch, RequestFailed, TokenizerLimits, decode, encode

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Prometheus metrics of one server, in a registry of its own: counters and histograms updated as outputs
    arrive, gauges refreshed from the scheduler's heartbeat on scrape."""

    def __init__(self, model_name: str, kv_cache_dtype: str = "unknown"):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.gauges = {  # heartbeat state key -> gauge
            "running": Gauge("minisgl_num_requests_running", "Requests being decoded", registry=r),
            "waiting": Gauge("minisgl_num_requests_waiting", "Requests queued for admission", registry=r),
            "compiling": Gauge(
                "minisgl_num_requests_compiling", "Requests waiting for their grammar to compile", registry=r
            ),
            "kv_pages_used": Gauge("minisgl_kv_pages_used", "KV cache pages owned by live requests", registry=r),
            "kv_pages_cached": Gauge("minisgl_kv_pages_cached", "KV cache pages held by the prefix cache", registry=r),
            "kv_pages_total": Gauge("minisgl_kv_pages_total", "Usable KV cache pages", registry=r),
            "kv_pages_free": Gauge("minisgl_kv_pages_free", "KV cache pages on the free list", registry=r),
            "kv_pages_reserved": Gauge(
                "minisgl_kv_pages_reserved", "Free KV cache pages reserved for admitted requests' growth", registry=r
            ),
        }
        self.preemptions = Counter(
            "minisgl_preemptions", "Running requests retracted for lack of KV pages (recomputed later)", registry=r
        )
        self._preemptions_seen = 0
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(
            "minisgl_requests_finished", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.aborted = Counter("minisgl_requests_aborted", "Requests aborted because the client went away", registry=r)
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds", "Request to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds", "Between two tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        Gauge("minisgl_model_info", "The served model", ["model"], registry=r).labels(model_name).set(1)
        Gauge("minisgl_kv_cache_info", "What the KV cache stores", ["dtype"], registry=r).labels(kv_cache_dtype).set(1)

    def update(self, state: dict[str, Any]) -> None:
        """Set the gauges from the scheduler's heartbeat state (kept as they are when it has none)."""
        for key, gauge in self.gauges.items():
            if key in state:
                gauge.set(state[key])
        seen = state.get("preemptions")
        if isinstance(seen, int) and seen > self._preemptions_seen:  # the scheduler's running total
            self.preemptions.inc(seen - self._preemptions_seen)
            self._preemptions_seen = seen

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerGone(RuntimeError):
    """A worker process died, or the server is shutting down; the request cannot be answered."""


class Sink(Protocol):
    """Where the outputs of one request go (a :class:`minisgl.server.serving.Job`): new text and the count of
    completion tokens so far, ``end`` being ``[reason, prompt_tokens, cached]``; a refusal before it ran; the server
    gone."""

    submitted: float  # time.monotonic() when it was sent
    last: float | None  # when its last output arrived

    def on_output(self, text: str, count: int, logprobs: list[Any] | None, end: list[Any] | None) -> None: ...

    def on_failed(self, field: str, message: str) -> None: ...

    def on_gone(self, reason: str) -> None: ...


class EngineClient:
    """Sends requests to the tokenizer workers and receives their outputs from the detokenizer."""

    def __init__(self, addresses: dict[str, str], metrics: ServerMetrics, tokenizers: list[str]):
        self.addresses = addresses
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.sinks: dict[int, Sink] = {}
        self._first: dict[int, int] = {}  # rid -> tokenizer worker, until its first output arrives
        self._route: dict[int, int] = {}  # rid -> tokenizer worker, while it runs
        self._load = [0] * len(tokenizers)
        self._rids = itertools.count(1)
        self.gone: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self, limits: TokenizerLimits | None = None) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.addresses["api"])
        self._pushes = []
        for name in self.tokenizers:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self.addresses[name])
            if limits is not None:
                await sock.send(encode(limits))  # first on the socket: before any request
            self._pushes.append(sock)
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self.sinks)

    def new_rid(self) -> int:
        return next(self._rids)

    async def submit(self, req: GenerateReq, sink: Sink) -> None:
        """Send ``req``; its outputs will go to ``sink``."""
        if self.gone is not None:
            raise ServerGone(self.gone)
        worker = min(range(len(self._load)), key=self._load.__getitem__)
        self._load[worker] += 1
        self._first[req.rid] = self._route[req.rid] = worker
        self.sinks[req.rid] = sink
        await self._pushes[worker].send(encode(req))

    async def abort(self, rid: int) -> None:
        """Stop request ``rid`` (its KV pages are freed); nothing more arrives for it."""
        sink, worker = self.release(rid)
        if sink is not None and worker is not None and self.gone is None:
            self.metrics.aborted.inc()
            await self._pushes[worker].send(encode(AbortReq(rid)))

    def release(self, rid: int) -> tuple[Sink | None, int | None]:
        """Forget a request that finished or was refused; its sink and tokenizer worker, if it was still known."""
        self._started(rid)
        return self.sinks.pop(rid, None), self._route.pop(rid, None)

    def _started(self, rid: int) -> None:
        worker = self._first.pop(rid, None)
        if worker is not None:
            self._load[worker] -= 1

    def fail_all(self, reason: str) -> None:
        """Wake every waiting request with :class:`ServerGone`."""
        self.gone = reason
        for sink in list(self.sinks.values()):
            sink.on_gone(reason)

    async def _read(self) -> None:
        while True:
            msg = decode(await self._pull.recv())
            if isinstance(msg, OutputBatch):
                self._deliver(msg)
                for rid, field, message in msg.failed:
                    self._fail(rid, field, message)
            elif isinstance(msg, RequestFailed):
                self._fail(msg.rid, msg.field, msg.message)

    def _fail(self, rid: int, field: str, message: str) -> None:
        sink, _ = self.release(rid)
        if sink is not None:
            sink.on_failed(field, message)

    def _deliver(self, batch: OutputBatch) -> None:
        now = time.monotonic()
        sinks = self.sinks
        ends = {e[0]: e for e in batch.finished}
        lps = batch.logprobs
        metrics = self.metrics
        first = self._first
        delivered = 0
        for i, (rid, text, count) in enumerate(zip(batch.rids, batch.texts, batch.counts, strict=True)):
            sink = sinks.get(rid)
            if sink is None:
                continue
            delivered += 1
            if rid in first:
                self._started(rid)
            if sink.last is None:
                metrics.ttft.observe(now - sink.submitted)
            else:
                metrics.itl.observe(now - sink.last)
            sink.last = now
            end = ends.get(i)
            if end is not None:
                del sinks[rid]
                self._route.pop(rid, None)
                metrics.finished.labels(end[1] or "unknown").inc()
                metrics.prompt_tokens.inc(end[2])
                end = end[1:]
            sink.on_output(text, count, lps[i] if lps is not None else None, end)
        if delivered:
            metrics.generation_tokens.inc(delivered)
