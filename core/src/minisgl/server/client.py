"""The API server's side of the ZMQ link: submit requests, route outputs back to them.

One reader task receives every message from the detokenizer and puts it on
the queue of the request it belongs to; handlers await their own queue. When
a worker dies, :meth:`EngineClient.fail_all` wakes every waiting handler with
:class:`ServerGone`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from ..message import (
    AbortReq,
    Accepted,
    GenerateReq,
    OutputBatch,
    RequestFailed,
    Stats,
    StatsReq,
    TokenOutput,
    decode,
    encode,
)
from .metrics import ServerMetrics


class ServerGone(RuntimeError):
    """A worker process died; the server cannot answer any more."""


@dataclass
class RequestStream:
    """Messages for one request, in arrival order."""

    rid: int
    queue: asyncio.Queue[Any]
    start: float = field(default_factory=time.monotonic)
    last: float | None = None
    done: bool = False


class EngineClient:
    """Sends requests to the tokenizer and receives their outputs from the detokenizer."""

    def __init__(self, addresses: dict[str, str], metrics: ServerMetrics):
        self.addresses = addresses
        self.metrics = metrics
        self.streams: dict[int, RequestStream] = {}
        self._stats: dict[int, asyncio.Future[Stats]] = {}
        self._rids = itertools.count(1)
        self._tokens = itertools.count(1)
        self.gone: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self.addresses["tokenizer"])
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.addresses["api"])
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished yet."""
        return sum(1 for s in self.streams.values() if not s.done)

    # ------------------------------------------------------------ requests
    def new_rid(self) -> int:
        return next(self._rids)

    async def submit(self, req: GenerateReq, queue: asyncio.Queue[Any]) -> RequestStream:
        """Send ``req``; its messages will arrive on ``queue`` (shared by the choices of one HTTP request)."""
        if self.gone is not None:
            raise ServerGone(self.gone)
        stream = RequestStream(req.rid, queue)
        self.streams[req.rid] = stream
        await self._push.send(encode(req))
        return stream

    async def abort(self, rid: int) -> None:
        stream = self.streams.pop(rid, None)
        if stream is not None and not stream.done and self.gone is None:
            self.metrics.aborted.inc()
            await self._push.send(encode(AbortReq(rid)))

    def release(self, rid: int) -> None:
        self.streams.pop(rid, None)

    async def stats(self, timeout: float = 5.0) -> Stats:
        """The scheduler's current state (a round trip through every worker)."""
        if self.gone is not None:
            raise ServerGone(self.gone)
        token = next(self._tokens)
        fut: asyncio.Future[Stats] = asyncio.get_running_loop().create_future()
        self._stats[token] = fut
        try:
            await self._push.send(encode(StatsReq(token)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats.pop(token, None)

    def fail_all(self, reason: str) -> None:
        """Wake every waiting request with :class:`ServerGone`."""
        self.gone = reason
        for stream in self.streams.values():
            stream.queue.put_nowait(ServerGone(reason))
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(ServerGone(reason))

    # -------------------------------------------------------------- reader
    async def _read(self) -> None:
        while True:
            msg = decode(await self._pull.recv())
            now = time.monotonic()
            if isinstance(msg, OutputBatch):
                for out in msg.outputs:
                    self._deliver(out, now)
            elif isinstance(msg, (Accepted, RequestFailed)):
                stream = self.streams.get(msg.rid)
                if isinstance(msg, Accepted):
                    self.metrics.prompt_tokens.inc(msg.prompt_tokens)
                if stream is not None:
                    stream.queue.put_nowait(msg)
            elif isinstance(msg, Stats):
                fut = self._stats.get(msg.token)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _deliver(self, out: TokenOutput, now: float) -> None:
        stream = self.streams.get(out.rid)
        if stream is None:
            return
        self.metrics.generation_tokens.inc(len(out.token_ids))
        if stream.last is None:
            self.metrics.ttft.observe(now - stream.start)
        else:
            self.metrics.itl.observe(now - stream.last)
        stream.last = now
        if out.finished:
            stream.done = True
            self.metrics.finished.labels(out.finish_reason or "unknown").inc()
        stream.queue.put_nowait(out)
