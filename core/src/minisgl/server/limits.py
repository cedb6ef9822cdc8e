"""Limits on HTTP requests, enforced before the application parses anything.

:class:`RequestGuard` is an ASGI middleware in front of the FastAPI routes:

- With ``--api-key`` set, the key is checked from the headers alone, so a client
  without it is refused (401) before a byte of its body is read. ``/health``
  and ``/metrics`` stay open for probes and scrapers; every other route,
  ``/docs`` and ``/openapi.json`` included, needs the key.
- A body may be at most ``--max-request-bytes``. A declared ``Content-Length``
  over the limit is refused (413) at once; a body without one (chunked) is
  counted as it arrives and refused as soon as it passes the limit. The routes
  only ever see a whole body within the limit, so one big request costs
  neither memory nor event-loop time that other requests are waiting for. The
  HTTP server discards the rest of a refused body as it arrives (nothing is
  kept), so the client still gets to read the answer.

:class:`RequestLimits` also bounds how many generations one request may ask
for (``--max-prompts``, ``--max-n``); the routes check that after parsing.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core import ValidationError

if TYPE_CHECKING:
    from .settings import ServeSettings

OPEN_PATHS = frozenset({"/health", "/metrics"})


def api_key_problem(authorization: str, api_key: str) -> str | None:
    """Why an ``Authorization`` header does not carry ``api_key``, or None when it does."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return None
    what = "missing" if not authorization else "incorrect"
    return f"{what} API key; send 'Authorization: Bearer <key>'"


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this server."""

    max_request_bytes: int
    max_prompts: int
    max_n: int
    api_key: str | None = None

    @classmethod
    def of(cls, settings: ServeSettings) -> RequestLimits:
        return cls(settings.max_request_bytes, settings.max_prompts, settings.max_n, settings.api_key)

    def check_choices(self, n: int, prompts: int = 1) -> None:
        """Refuse (400, :class:`~minisgl.core.ValidationError`) more prompts or choices than allowed."""
        if n > self.max_n:
            raise ValidationError("n", f"this server gives at most {self.max_n} choices per prompt (--max-n), got {n}")
        if prompts > self.max_prompts:
            raise ValidationError(
                "prompt",
                f"this server takes at most {self.max_prompts} prompts per request (--max-prompts), got {prompts}; "
                "send them in several requests",
            )


def _error_body(message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    body = _error_body(message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: the API key from the headers, then the body size, before the routes run."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        key = self.limits.api_key
        if key is not None and scope["path"] not in OPEN_PATHS:
            problem = api_key_problem(headers.get("authorization", ""), key)
            if problem is not None:
                await _refuse(send, 401, problem, "invalid_api_key")
                return
        declared = headers.get("content-length")
        if declared is None and "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)  # no body
            return
        limit = self.limits.max_request_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, self._too_large(f"is {int(declared):,} bytes, over"), "request_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, 413, self._too_large("is over"), "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, what: str) -> str:
        limit = self.limits.max_request_bytes
        return (
            f"the request body {what} this server's limit of {limit:,} bytes (--max-request-bytes); "
            "send a shorter prompt or conversation"
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the body already read, then whatever the connection says next."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
