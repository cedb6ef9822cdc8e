"""A fake OpenAI-compatible server for testing ``minisgl bench serve`` and measuring its ceiling.

Each completion request is answered by a script: a function from the request body
to a ``Reply`` (status, streamed events with the delay before each, or a dropped
connection). The server speaks HTTP/1.1 with chunked streaming bodies, like the
uvicorn-based servers the client meets in practice.

Run alone, it streams like an engine decoding in steps: every ``--interval``
seconds one one-token chunk to each open stream, until that stream has its
``max_tokens``, then a usage chunk. With a short interval this measures how many
chunks per second the client ingests::

    python -m minisgl_bench.serve_fake --port 30001 --interval 0.005 &
    minisgl bench serve --base-url http://127.0.0.1:30001 --tokenizer TOKENIZER --warmup 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

DONE = b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_event(text: str, chat: bool = True) -> bytes:
    """A streamed chunk carrying ``text`` (with ``"usage": null``, as servers do when usage is asked for)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": None}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _event({"id": "fake", "object": kind, "model": "fake", "choices": [choice], "usage": None})


def role_event() -> bytes:
    """The chat stream's opening chunk: a role and empty content (no output yet)."""
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    return _event({"id": "fake", "object": "chat.completion.chunk", "choices": [choice], "usage": None})


def usage_event(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
    """The final chunk of ``stream_options.include_usage``: no choices, the token counts.

    ``cached_tokens`` (prompt tokens served from a prefix cache) goes in ``prompt_tokens_details``.
    """
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return _event({"id": "fake", "object": "chat.completion.chunk", "choices": [], "usage": usage})


def error_event(message: str) -> bytes:
    """An error reported inside a stream that has already begun."""
    return _event({"error": {"message": message, "type": "server_error"}})


@dataclass(frozen=True)
class Reply:
    """The fake server's answer to one completion request."""

    status: int = 200
    events: list[tuple[float, bytes]] = field(default_factory=list)
    """(seconds to wait, bytes to send) in order; for a 200 streaming reply."""
    drop: bool = False
    """Cut the connection after the events instead of ending the body."""
    body: bytes = b""
    """The JSON body of a non-200 reply."""


Script = Callable[[dict[str, Any]], Reply]


def stream_reply(
    texts: list[str],
    first_delay: float,
    gap: float,
    usage: tuple[int, int] | tuple[int, int, int] | None = None,
    chat: bool = True,
) -> Reply:
    """A role chunk at once, the first text after ``first_delay``, the rest ``gap`` apart, usage, [DONE]."""
    events = [(0.0, role_event())] if chat else []
    events += [(first_delay if i == 0 else gap, text_event(t, chat)) for i, t in enumerate(texts)]
    if usage is not None:
        events.append((0.0, usage_event(*usage)))
    events.append((0.0, DONE))
    return Reply(events=events)


class FakeServer:
    """An asyncio HTTP server that answers completions by ``script``; counts what it sees.

    Without a script it decodes in steps: every ``interval`` seconds it sends one
    one-token chunk to every open stream (all in one pass, as an engine step would),
    and, given ``trace`` (an open text file), writes a line of the step trace for each
    step that had streams open (the format of ``minisgl serve --trace-steps``).
    """

    def __init__(
        self,
        script: Script | None,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "fake-model",
        interval: float = 0.0,
        root: str | None = None,
        trace: TextIO | None = None,
    ):
        self.script = script
        self.interval = interval
        self.root = root
        self.trace = trace
        self._steps = 0
        # step mode: [writer, tokens left, tokens asked, finished future, chunk frame] per open stream
        self._open: list[list[Any]] = []
        self._stepper: asyncio.Task[None] | None = None
        self.host = host
        self.port = port
        self.model = model
        self.bodies: list[dict[str, Any]] = []
        self.arrivals: list[float] = []  # time.perf_counter() at each completion request
        self.in_flight = 0
        self.max_in_flight = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.script is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # Newer Pythons wait here for open connections; a stalled client must not hang the caller.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path = head[0].split()[:2]
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            raw = await reader.readexactly(length) if length else b""
            if method == "GET" and path.endswith("/v1/models"):
                card = {"id": self.model, "object": "model", **({"root": self.root} if self.root else {})}
                await self._respond(writer, 200, json.dumps({"object": "list", "data": [card]}).encode())
            elif method == "POST" and path.endswith(("/v1/chat/completions", "/v1/completions")):
                body = json.loads(raw)
                self.arrivals.append(time.perf_counter())
                self.bodies.append(body)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    if self.script is None:
                        await self._stepped(writer, int(body.get("max_tokens", 16)), "messages" in body)
                    else:
                        await self._stream(writer, self.script(body))
                finally:
                    self.in_flight -= 1
            else:
                await self._respond(writer, 404, b'{"error": {"message": "not found"}}')
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        if reply.status != 200:
            await self._respond(writer, reply.status, reply.body)
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for delay, data in reply.events:
            await asyncio.sleep(delay)  # sleep(0) still lets the other streams take turns
            writer.write(_frame(data))
            await writer.drain()
        if reply.drop:
            writer.transport.abort()
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _stepped(self, writer: asyncio.StreamWriter, max_tokens: int, chat: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        finished = asyncio.get_running_loop().create_future()
        self._open.append([writer, max_tokens, max_tokens, finished, _frame(text_event(" tok", chat))])
        await finished

    def _trace_step(self, began: float, gap: float, new: int) -> None:
        """One line of the step trace: every open stream decodes, the ``new`` ones (just admitted) prefill."""
        assert self.trace is not None
        n = len(self._open)
        step: dict[str, Any] = {"step": self._steps, "t": began, "kind": "mixed" if new else "decode", "reqs": n}
        step.update(prefill_reqs=new, decode_reqs=n - new, tokens=n, prefill_tokens=new, running=n, waiting=0)
        step.update(free_pages=0, reserved_pages=0, host_ms=0.0, gpu_ms=None, gap_ms=gap * 1000.0, events=[])
        self.trace.write(json.dumps(step) + "\n")
        self.trace.flush()
        self._steps += 1

    async def _step_forever(self) -> None:
        last = time.time()
        seen = 0  # streams opened before this step
        while True:
            await asyncio.sleep(self.interval)
            now = time.time()
            if self.trace is not None and self._open:
                opened = len(self.bodies)
                self._trace_step(now, now - last, min(opened - seen, len(self._open)))
                seen = opened
            last = now
            still = []
            for entry in self._open:
                writer, left, asked, finished, frame = entry
                writer.write(frame)
                entry[1] = left - 1
                if left > 1:
                    still.append(entry)
                else:
                    writer.write(_frame(usage_event(1, asked) + DONE) + b"0\r\n\r\n")
                    finished.set_result(None)
            self._open = still


def _frame(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked HTTP body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


@contextmanager
def fake_server_thread(script: Script, model: str = "fake-model", root: str | None = None) -> Iterator[FakeServer]:
    """A ``FakeServer`` running on its own event loop in a background thread, for the length of the block."""
    server = FakeServer(script, model=model, root=root)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()
        pending = asyncio.all_tasks(loop)  # streams still open (a client that timed out, the step task)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(server.close())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fake server did not start")
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main(argv: list[str] | None = None) -> int:
    """Serve in step mode until interrupted (``python -m minisgl_bench.serve_fake``)."""
    p = argparse.ArgumentParser(description="stream one-token chunks in engine-like steps (client ceiling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--interval", type=float, default=0.005, help="seconds between steps (0: flat out)")
    p.add_argument("--root", default=None, help="the model card's root (what minisgl serve reports as its model)")
    p.add_argument("--trace-steps", default=None, metavar="FILE", help="write a step trace (JSON Lines) to FILE")
    args = p.parse_args(argv)

    async def serve(trace: TextIO | None) -> None:
        server = FakeServer(None, args.host, args.port, interval=args.interval, root=args.root, trace=trace)
        await server.start()
        print(f"fake server on {server.url}", flush=True)
        await asyncio.Event().wait()

    def run(runner: asyncio.Runner) -> None:
        if args.trace_steps is None:
            runner.run(serve(None))
            return
        with open(args.trace_steps, "a") as trace:
            header = {"trace": "minisgl-steps", "version": 1, "start": time.time(), "pid": os.getpid()}
            header.update(model="fake-model", device="cpu", page_size=1, num_pages=0, chunked_prefill_size=0)
            trace.write(json.dumps({**header, "max_running_requests": 0}) + "\n")
            trace.flush()
            runner.run(serve(trace))

    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        run(runner)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
