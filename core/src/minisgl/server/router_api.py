"""What a router in front of several servers needs from each (see docs/design.md, "Data parallelism").

sglang-router asks a new worker for ``/server_info`` and ``/model_info`` (the model id it routes by comes from
``served_model_name``), checks ``/health``, and forwards each request re-serialised with its own extension fields
added, each at the value that asks for nothing. :class:`RouterFields` drops exactly those no-op values, so the
request reaches the app as the client wrote it; any other value of such a field is refused as an unknown argument,
as it would be without a router.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..utils import VERSION

# Fields sglang-router adds to every request it forwards, with the value that means "not asked for" (a request
# without a model gets the model "unknown").
ROUTER_NO_OPS: dict[str, bool | str] = {
    "model": "unknown",
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_MARKERS = tuple(f'"{name}"'.encode() for name in ROUTER_NO_OPS if name != "model")


def _same(value: object, no_op: bool | str) -> bool:
    return type(value) is type(no_op) and value == no_op


def drop_router_no_ops(body: bytes) -> bytes:
    """``body`` without the router's no-op fields; unchanged when it has none or is not a JSON object."""
    if not any(marker in body for marker in _MARKERS):
        return body
    try:
        data = json.loads(body)
    except ValueError:
        return body  # the app reports the bad JSON
    if not isinstance(data, dict):
        return body
    kept = {k: v for k, v in data.items() if not (k in ROUTER_NO_OPS and _same(v, ROUTER_NO_OPS[k]))}
    return body if len(kept) == len(data) else json.dumps(kept).encode()


class RouterFields:
    """ASGI middleware for the generation routes: the body without the router's no-op fields. It runs inside
    :class:`~minisgl.server.app.RequestGuard`, so the body it reads has already passed the size limit."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTED_PATHS:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # nobody to answer
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = drop_router_no_ops(b"".join(chunks))
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-length", b"transfer-encoding")]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, replay_body(body, receive), send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the body already read, then whatever the connection says next."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def add_router_routes(app: FastAPI, model_name: str, info: dict[str, Any]) -> None:
    """``GET /server_info`` and ``GET /model_info``: what a router registers a worker with."""
    server = {
        "served_model_name": model_name,
        "version": VERSION,
        "max_model_len": info.get("max_model_len"),
        "tp_size": info.get("tp"),
        "dp_size": 1,  # one engine per server; replicas are separate servers
        "page_size": info.get("page_size"),
        "max_running_requests": info.get("max_running_requests"),
    }
    model = {
        "served_model_name": model_name,
        "is_generation": True,
        "max_model_len": info.get("max_model_len"),
        "vocab_size": info.get("vocab_size"),
        "architecture": info.get("architecture"),
    }

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return server

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return model
