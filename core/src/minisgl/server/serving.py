"""Running one HTTP request's generations (*jobs*: ``n`` choices of each prompt) and shaping OpenAI responses.

The response starts only once every job has its first output, so a refused job is a plain 400 even when streaming.
Outputs land in their job (no queue entry per token); the response wakes once for all that arrived since it last
looked and sends one chunk per job, so a response that falls behind catches up in fewer, larger chunks. Whatever
ends a request early aborts its unfinished jobs, which frees their KV pages.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from ..core import LOGPROB_FLOOR
from ..message import GenerateReq
from .client import EngineClient
from .tools import CallStream, parse_whole


class APIError(Exception):
    """An error answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def gone_error(reason: str) -> APIError:
    return APIError(503, f"the server cannot answer: {reason}", "server_error", code="service_unavailable")


class ClientGone(Exception):
    """The HTTP client disconnected."""


@dataclass(eq=False)
class Job:
    """One generation: choice ``index`` of prompt ``prompt_index``; the client's reader fills it in."""

    req: GenerateReq
    index: int
    prompt_index: int
    gen: Generation = field(init=False, repr=False)  # set by the Generation that runs it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    pieces: list[str] = field(default_factory=list)  # text not yet sent (all of it, when not streaming)
    logprobs: list[list[Any]] = field(default_factory=list)  # entries not yet sent
    finish_reason: str | None = None
    finished: bool = False
    finish_sent: bool = False
    started: bool = False  # its first output arrived
    failure: tuple[str, str] | None = None  # (field, message) when refused
    submitted: float = 0.0
    last: float | None = None
    tools: CallStream | None = None  # parses tool calls out of the text (chat with tools)
    calls_sent: int = 0  # tool calls streamed so far

    def on_output(self, text: str, count: int, logprobs: list[Any] | None, end: list[Any] | None) -> None:
        self.started = True
        if text:
            self.pieces.append(text)
        self.completion_tokens = count
        if logprobs:
            self.logprobs.extend(logprobs)
        if end is not None:
            self.finished = True
            self.finish_reason, self.prompt_tokens, self.cached_tokens = end
        self.gen.notify(self)

    def on_failed(self, field: str, message: str) -> None:
        self.failure = (field, message)
        self.finished = True  # refused: nothing to abort
        self.gen.notify(self)

    def on_gone(self, reason: str) -> None:
        self.gen.notify_gone(reason)

    def take_text(self) -> str:
        text = "".join(self.pieces)
        self.pieces.clear()
        return text


def usage(jobs: list[Job]) -> dict[str, Any]:
    """Usage over jobs; a prompt shared by ``n`` choices counts once."""
    firsts = {j.prompt_index: j for j in reversed(jobs)}
    prompt = sum(j.prompt_tokens for j in firsts.values())
    completion = sum(j.completion_tokens for j in jobs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(j.cached_tokens for j in firsts.values())},
    }


class Generation:
    """The jobs of one HTTP request, woken when any of them has news."""

    def __init__(self, client: EngineClient, receive: Receive, jobs: list[Job], fields: dict[str, str]):
        self.client = client
        self.receive = receive
        self.order = jobs
        self.fields = fields  # a worker's field name -> the request's
        self.wake = asyncio.Event()
        self.dirty: dict[Job, None] = {}  # the jobs with output not looked at yet, in the order it came
        self.client_gone = False
        self.server_gone: str | None = None
        self._watch: asyncio.Task[None] | None = None
        for job in jobs:
            job.gen = self

    def notify(self, job: Job) -> None:
        self.dirty[job] = None
        self.wake.set()

    def notify_gone(self, reason: str) -> None:
        self.server_gone = reason
        self.wake.set()

    async def _watch_disconnect(self) -> None:
        """Wait for the client to hang up (one task per request, no polling)."""
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.wake.set()

    async def wait(self) -> None:
        """Wait for news; raise if the client or the server is gone."""
        self.wake.clear()
        await self.wake.wait()
        self._check()

    def _check(self) -> None:
        if self.client_gone:
            raise ClientGone()
        if self.server_gone is not None:
            raise gone_error(self.server_gone)

    async def start(self) -> None:
        """Submit every job and wait until each has its first output (or one is refused: :class:`APIError`)."""
        self._watch = asyncio.create_task(self._watch_disconnect())
        try:
            now = time.monotonic()
            for job in self.order:
                job.submitted = now
                await self.client.submit(job.req, job)
            while True:
                self._check()
                for job in self.order:
                    if job.failure is not None:
                        param = self.fields.get(job.failure[0], job.failure[0])
                        raise APIError(400, f"{param}: {job.failure[1]}", param=param)
                if all(j.started for j in self.order):
                    return
                await self.wait()
        except BaseException:
            await self.close()
            raise

    async def updates(self) -> list[Job]:
        """The jobs with output not yet looked at (waiting for some); [] once all are finished and seen."""
        while not self.dirty:
            if all(j.finished for j in self.order):
                return []
            await self.wait()
        self._check()
        jobs = list(self.dirty)
        self.dirty.clear()
        return jobs

    async def close(self) -> None:
        """Abort unfinished jobs (their pages are freed) and forget the rest."""
        if self._watch is not None:
            self._watch.cancel()
        for job in self.order:
            if job.finished:
                self.client.release(job.req.rid)
            else:
                await self.client.abort(job.req.rid)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else _dumps(data)}\n\n"


# --------------------------------------------------------------- logprobs
def _finite(lp: float) -> float:
    """A logprob as JSON can carry it: -inf and NaN (no probability) become OpenAI's floor."""
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


def _alternatives(top: list[list[Any]]) -> list[tuple[str, float]]:
    """The alternatives that have a probability (a token a grammar forbids is none)."""
    return [(a, alp) for a, alp in top if math.isfinite(alp)]


def chat_logprobs(entries: list[list[Any]]) -> dict[str, Any]:
    def item(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in _alternatives(top)]} for t, lp, top in entries
        ]
    }


def completion_logprobs(entries: list[list[Any]], offset: int) -> dict[str, Any]:
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [_finite(lp) for _, lp, _ in entries],
        "top_logprobs": [{a: alp for a, alp in _alternatives(top)} for _, _, top in entries],
        "text_offset": offsets,
    }


def _tool_finish(reason: str | None) -> str | None:
    """A reply that ended by itself with calls finished for them (``tool_calls``); a cut one stays ``length``."""
    return "tool_calls" if reason == "stop" else reason


# ----------------------------------------------------------------- shapes
class ResponseShape:
    """Chat or completions: how choices, chunks and logprobs look."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, include_usage: bool):
        self.chat = chat
        self.model = model
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}
        # A streamed chunk is this head, the choice, and the tail: only the choice changes.
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'data: {{"id":{_dumps(self.id)},"object":"{kind}","created":{self.created},'
            f'"model":{_dumps(model)},"choices":[{{"index":'
        )
        self._tail = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, job: Job) -> dict[str, Any] | None:
        """The logprobs of ``job`` not sent yet (None unless asked for); completions count their text offsets."""
        entries, job.logprobs = job.logprobs, []
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries)
        offset = self._offsets.get(job.index, 0)
        self._offsets[job.index] = offset + sum(len(t) for t, _, _ in entries)
        return completion_logprobs(entries, offset)

    def full(self, jobs: list[Job]) -> dict[str, Any]:
        choices = []
        for job in sorted(jobs, key=lambda j: j.index):
            text, finish_reason, lp = job.take_text(), job.finish_reason, self._logprobs(job)
            if not self.chat:
                choices.append({"index": job.index, "text": text, "logprobs": lp, "finish_reason": finish_reason})
                continue
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if job.tools is not None:
                message["content"], calls = parse_whole(job.tools, text)
                if calls:
                    message["tool_calls"] = [c.as_openai() for c in calls]
                    finish_reason = _tool_finish(finish_reason)
            choices.append({"index": job.index, "message": message, "logprobs": lp, "finish_reason": finish_reason})
        return {**self._envelope(choices, False), "usage": usage(jobs)}

    def first_chunks(self, jobs: list[Job]) -> str:
        if not self.chat:
            return ""
        return "".join(self._chunk(j.index, '{"role":"assistant","content":""}', None, None) for j in jobs)

    def _chunk(self, index: int, delta: str, lp: Any, finish_reason: str | None) -> str:
        key = '"delta":' if self.chat else '"text":'
        lp_json = "null" if lp is None else _dumps(lp)
        finish = "null" if finish_reason is None else _dumps(finish_reason)
        return f'{self._head}{index},{key}{delta},"logprobs":{lp_json},"finish_reason":{finish}{self._tail}'

    def job_chunk(self, job: Job) -> str:
        """The chunks with everything new of ``job`` (empty if there is nothing to send). With tools: content
        deltas, and per call a delta with its index, id, type and name (arguments empty) followed by its argument
        fragments; logprobs and finish on the last."""
        text = job.take_text()
        lp = self._logprobs(job) if job.logprobs else None
        ending = job.finished and not job.finish_sent
        finish = job.finish_reason if ending else None
        job.finish_sent |= ending
        if job.tools is not None:
            events = job.tools.feed(text) + (job.tools.finish() if ending else [])
        else:
            events = [("content", text)] if text else []
        deltas: list[str] = []
        for kind, value in events:
            if kind == "content":
                deltas.append('{"content":' + _dumps(value) + "}" if self.chat else _dumps(value))
                continue
            if kind in ("call", "head"):
                job.calls_sent += 1
                head = {"index": job.calls_sent - 1, "id": value.id, "type": "function"}
                head["function"] = {"name": value.name, "arguments": ""}
                deltas.append(_dumps({"tool_calls": [head]}))
            args = value.arguments if kind == "call" else value if kind == "args" else ""
            if args:
                part = {"index": job.calls_sent - 1, "function": {"arguments": args}}
                deltas.append(_dumps({"tool_calls": [part]}))
        if finish is not None and job.calls_sent:
            finish = _tool_finish(finish)
        if not deltas and lp is None and finish is None:
            return ""  # text held back (partial character, possible stop string or tool-call marker)
        deltas = deltas or ["{}" if self.chat else '""']
        last = len(deltas) - 1
        return "".join(
            self._chunk(job.index, d, lp if i == last else None, finish if i == last else None)
            for i, d in enumerate(deltas)
        )

    def usage_chunk(self, jobs: list[Job]) -> dict[str, Any]:
        return {**self._envelope([], True), "usage": usage(jobs)}


async def stream_events(gen: Generation, shape: ResponseShape) -> AsyncIterator[bytes]:
    """The SSE body of a streaming response; aborts unfinished jobs however it ends."""
    try:
        first = shape.first_chunks(gen.order)
        if first:
            yield first.encode()
        while jobs := await gen.updates():
            body = "".join(shape.job_chunk(job) for job in jobs)
            if body:
                yield body.encode()
        tail = sse(shape.usage_chunk(gen.order)) if shape.include_usage else ""
        yield (tail + sse("[DONE]")).encode()
    except APIError as exc:  # the workers died or the server is shutting down: the status line is sent
        yield (sse(exc.body()) + sse("[DONE]")).encode()
    except ClientGone:
        pass
    finally:
        await gen.close()


async def collect(gen: Generation, shape: ResponseShape) -> dict[str, Any]:
    """The whole (non-streaming) response."""
    try:
        while not all(j.finished for j in gen.order):
            await gen.wait()
    finally:
        await gen.close()
    return shape.full(gen.order)
