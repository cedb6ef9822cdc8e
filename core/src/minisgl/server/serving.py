"""Running one HTTP request's generations and shaping them as OpenAI responses.

An HTTP request becomes one or more *jobs* (``n`` choices, several completion
prompts), all sent to the workers at once and answered on one queue. The
response starts only when every job is accepted, so a refused job (prompt too
long, ...) is a plain 400 even for a streaming request. Whatever ends the
request early (client gone, error) aborts the jobs still running, which frees
their KV pages.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from ..message import Accepted, GenerateReq, RequestFailed, TokenOutput
from .client import EngineClient, ServerGone


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


@dataclass
class Job:
    """One generation: choice ``index`` of prompt ``prompt_index``."""

    req: GenerateReq
    index: int
    prompt_index: int
    prompt_tokens: int = 0
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[list[Any]] = field(default_factory=list)
    finished: bool = False

    @property
    def rid(self) -> int:
        return self.req.rid

    def add(self, out: TokenOutput) -> None:
        self.text.append(out.text)
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


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


# How often a request's handler checks that its HTTP client is still there (seconds): a client
# that leaves frees its KV pages within about this long.
DISCONNECT_CHECK_S = 0.25


class Generation:
    """The jobs of one HTTP request and the queue their messages arrive on."""

    def __init__(self, client: EngineClient, request: Request, jobs: list[Job], *, prompt_field: str):
        self.client = client
        self.request = request
        self.jobs = {j.rid: j for j in jobs}
        self.order = jobs
        self.prompt_field = prompt_field
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._early: list[TokenOutput] = []
        self._check_at = time.monotonic() + DISCONNECT_CHECK_S

    async def _next(self) -> Any:
        while True:
            # Outputs may arrive without pause for a long time: look for a gone client regularly regardless.
            now = time.monotonic()
            if now >= self._check_at:
                self._check_at = now + DISCONNECT_CHECK_S
                if await self.request.is_disconnected():
                    raise ClientGone()
            try:
                msg = await asyncio.wait_for(self.queue.get(), DISCONNECT_CHECK_S)
            except TimeoutError:
                continue
            if isinstance(msg, ServerGone):
                raise gone_error(str(msg))
            return msg

    async def start(self) -> None:
        """Submit every job and wait until all are accepted (or one is refused: :class:`APIError`)."""
        try:
            for job in self.order:
                await self.client.submit(job.req, self.queue)
            pending = set(self.jobs)
            while pending:
                msg = await self._next()
                if isinstance(msg, Accepted):
                    self.jobs[msg.rid].prompt_tokens = msg.prompt_tokens
                    pending.discard(msg.rid)
                elif isinstance(msg, RequestFailed):
                    self.jobs[msg.rid].finished = True  # refused: nothing to abort
                    param = self.prompt_field if msg.field == "prompt" else msg.field
                    raise APIError(400, f"{param}: {msg.message}", param=param)
                elif isinstance(msg, TokenOutput):
                    self._early.append(msg)  # another job's output, ahead of this one's acceptance
        except BaseException:
            await self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[Job, TokenOutput]]:
        """Every output, in arrival order, until all jobs are finished."""
        for out in self._early:
            job = self.jobs[out.rid]
            job.add(out)
            yield job, out
        self._early = []
        while not all(j.finished for j in self.order):
            msg = await self._next()
            if isinstance(msg, TokenOutput) and msg.rid in self.jobs:
                job = self.jobs[msg.rid]
                job.add(msg)
                yield job, msg

    async def close(self) -> None:
        """Abort unfinished jobs (their pages are freed) and forget the rest."""
        for job in self.order:
            if job.finished:
                self.client.release(job.rid)
            else:
                await self.client.abort(job.rid)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------- logprobs
def chat_logprobs(entries: list[list[Any]]) -> dict[str, Any]:
    def item(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]} for t, lp, top in entries]}


def completion_logprobs(entries: list[list[Any]], offset: int) -> dict[str, Any]:
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{a: alp for a, alp in top} for _, _, top in entries],
        "text_offset": offsets,
    }


# ----------------------------------------------------------------- shapes
class ResponseShape:
    """Chat or completions: how choices, chunks and logprobs look."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, include_usage: bool):
        self.chat = chat
        self.model = model
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, jobs: list[Job]) -> dict[str, Any]:
        choices = []
        for job in sorted(jobs, key=lambda j: j.index):
            text = "".join(job.text)
            lp = None
            if self.want_logprobs:
                lp = chat_logprobs(job.logprobs) if self.chat else completion_logprobs(job.logprobs, 0)
            choice: dict[str, Any] = {"index": job.index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=lp, finish_reason=job.finish_reason)
            choices.append(choice)
        return {**self._envelope(choices, False), "usage": usage(jobs)}

    def first_chunks(self, jobs: list[Job]) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [self.chunk(j.index, {"role": "assistant", "content": ""}, None, None) for j in jobs]

    def chunk(self, index: int, delta: Any, lp: Any, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice.update(logprobs=lp, finish_reason=finish_reason)
        out = self._envelope([choice], True)
        if self.include_usage:
            out["usage"] = None
        return out

    def output_chunk(self, job: Job, out: TokenOutput) -> dict[str, Any] | None:
        lp = None
        if self.want_logprobs and out.logprobs:
            if self.chat:
                lp = chat_logprobs(out.logprobs)
            else:
                offset = self._offsets.get(job.index, 0)
                lp = completion_logprobs(out.logprobs, offset)
                self._offsets[job.index] = offset + sum(len(t) for t, _, _ in out.logprobs)
        if not out.text and lp is None and not out.finished:
            return None  # text held back (partial character or possible stop string)
        delta: Any = ({"content": out.text} if out.text else {}) if self.chat else out.text
        return self.chunk(job.index, delta, lp, out.finish_reason if out.finished else None)

    def usage_chunk(self, jobs: list[Job]) -> dict[str, Any]:
        return {**self._envelope([], True), "usage": usage(jobs)}


async def stream_events(gen: Generation, shape: ResponseShape) -> AsyncIterator[str]:
    """The SSE body of a streaming response; aborts unfinished jobs however it ends."""
    try:
        for c in shape.first_chunks(gen.order):
            yield sse(c)
        async for job, out in gen.outputs():
            chunk = shape.output_chunk(job, out)
            if chunk is not None:
                yield sse(chunk)
        if shape.include_usage:
            yield sse(shape.usage_chunk(gen.order))
        yield sse("[DONE]")
    except APIError as exc:  # the workers died mid-stream: the status line is already sent
        yield sse(exc.body())
        yield sse("[DONE]")
    except ClientGone:
        pass
    finally:
        await gen.close()


async def collect(gen: Generation, shape: ResponseShape) -> dict[str, Any]:
    """The whole (non-streaming) response."""
    try:
        async for _ in gen.outputs():
            pass
    finally:
        await gen.close()
    return shape.full(gen.order)
