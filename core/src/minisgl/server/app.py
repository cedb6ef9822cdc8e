"""The FastAPI application: OpenAI routes, /health, /metrics, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..core import SamplingParams, ValidationError
from ..message import GenerateReq
from .client import EngineClient, ServerGone
from .limits import RequestGuard, RequestLimits
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import APIError, ClientGone, Generation, Job, ResponseShape, collect, gone_error, stream_events
from .settings import ServeSettings

logger = logging.getLogger("minisgl.server")


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, so an abandoned stream aborts its jobs at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _error(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


# Union alternatives show up in an error's location ("stop", "list[str]", 0); they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "the request body is invalid")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    param = _param(tuple(err.get("loc", ())))
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {err['msg']}")
    if err.get("type") == "missing":
        return APIError(400, f"{param}: this field is required", param=param)
    if param.startswith("prompt") and err.get("type") != "value_error":
        message = "expected a string, a list of strings, a list of token ids or a list of token-id lists"
        return APIError(400, f"prompt: {message}", param="prompt")
    if err.get("type") == "value_error":
        return APIError(400, f"{param}: {str(err['msg']).removeprefix('Value error, ')}", param=param)
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return APIError(400, f"{param}: {err['msg']} (got {got})", param=param)


def create_app(
    settings: ServeSettings, addresses: dict[str, str], info: dict[str, Any], check_workers: Callable[[], str | None]
) -> FastAPI:
    """The application for one server; ``check_workers`` says why the workers can no longer serve, or None."""
    model_name = settings.model_name
    metrics = ServerMetrics(model_name)
    client = EngineClient(addresses, metrics)

    async def watch_workers(app: FastAPI) -> None:
        while True:
            reason = check_workers()
            if reason is not None:
                logger.error("%s; shutting down", reason)
                client.fail_all(reason)
                app.state.exit_code = 1
                await asyncio.sleep(1.0)  # let the 503 answers go out
                server = app.state.server
                if server is not None:
                    server.should_exit = True
                return
            await asyncio.sleep(0.2)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        watcher = asyncio.create_task(watch_workers(app))
        yield
        watcher.cancel()
        await client.close()

    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan)
    app.state.exit_code = 0
    app.state.server = None
    app.state.client = client
    app.state.metrics = metrics
    created = int(time.time())
    # The key and the body size are checked before any route parses the body (also guards /docs).
    limits = RequestLimits.of(settings)
    app.add_middleware(RequestGuard, limits=limits)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(exc))

    @app.exception_handler(ValidationError)
    async def _bad_value(request: Request, exc: ValidationError) -> JSONResponse:
        return _error(APIError(400, f"{exc.field}: {exc.message}", param=exc.field))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, str(exc.detail), type_))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{model_name}'",
                "not_found_error",
                param="model",
                code="model_not_found",
            )

    async def respond(request: Request, jobs: list[Job], shape: ResponseShape, stream: bool, field: str) -> Response:
        gen = Generation(client, request, jobs, prompt_field=field)
        try:
            await gen.start()
            if stream:
                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                return SSEResponse(stream_events(gen, shape), media_type="text/event-stream", headers=headers)
            return JSONResponse(await collect(gen, shape))
        except ServerGone as exc:
            raise gone_error(str(exc)) from None
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        limits.check_choices(body.n)
        messages = [m.plain() for m in body.messages]
        params: list[SamplingParams] = [body.params(i) for i in range(body.n)]
        jobs = [Job(GenerateReq(client.new_rid(), p.to_dict(), messages=messages), i, 0) for i, p in enumerate(params)]
        shape = ResponseShape(True, model_name, body.logprobs, body.include_usage)
        return await respond(request, jobs, shape, body.stream, "messages")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo: echoing the prompt is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix: suffixes are not supported", param="suffix")
        limits.check_choices(body.n, len(body.prompts()))
        jobs = []
        for pi, prompt in enumerate(body.prompts()):
            for i in range(body.n):
                p = body.params(i).to_dict()
                rid = client.new_rid()
                req = (
                    GenerateReq(rid, p, text=prompt)
                    if isinstance(prompt, str)
                    else GenerateReq(rid, p, input_ids=prompt)
                )
                jobs.append(Job(req, pi * body.n + i, pi))
        shape = ResponseShape(False, model_name, body.logprobs is not None, body.include_usage)
        return await respond(request, jobs, shape, body.stream, "prompt")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "minisgl",
            "root": settings.model,
            "max_model_len": info.get("max_model_len"),
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        wait = settings.health_timeout
        try:
            stats = await client.stats(timeout=wait)
        except ServerGone as exc:
            return _error(APIError(503, f"not ready: {exc}", "server_error", code="service_unavailable"))
        except TimeoutError:
            if client.in_flight:
                # The scheduler answers between steps: one long step (a big prefill on a CPU) with
                # requests in flight is work, not a hang. A dead scheduler is ServerGone instead.
                return JSONResponse({"status": "busy", "model": model_name, "in_flight": client.in_flight})
            reason = f"the scheduler did not answer within {wait:g} s"
            return _error(APIError(503, f"not ready: {reason}", "server_error", code="service_unavailable"))
        metrics.update(stats)
        return JSONResponse({"status": "ok", "model": model_name, "running": stats.running, "waiting": stats.waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Still serve the counters when the scheduler does not answer; the gauges keep their last values.
        with contextlib.suppress(ServerGone, TimeoutError):
            metrics.update(await client.stats(timeout=settings.health_timeout))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
