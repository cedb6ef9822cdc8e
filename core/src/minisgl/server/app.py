"""The FastAPI application: OpenAI routes, /tokenize, /health, /metrics, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core import ValidationError
from ..message import GenerateReq, TokenizerLimits
from ..utils import VERSION
from ..utils.heap import loading_quietly
from .client import EngineClient, ServerGone, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .router_api import RouterFields, add_router_routes, replay_body
from .serving import APIError, ClientGone, Generation, Job, ResponseShape, collect, gone_error, stream_events
from .settings import ServeSettings
from .text_tools import TextTools, load_model_tokenizer
from .tools import ForcedStream, choose_parser, make_stream
from .validate import BodyError

if TYPE_CHECKING:
    from .launcher import Launcher

logger = logging.getLogger("minisgl.server")
OPEN_PATHS = frozenset({"/health", "/metrics"})
# What the engine was built with (as the "model ready" log line says), in the model card for clients and operators.
_ENGINE_KEYS = (
    "architecture", "device", "tp", "attention_backend", "prefix_cache", "kv_pages", "page_size", "kv_cache_dtype",
    "max_running_requests", "chunked_prefill_size", "cuda_graphs", "prefill_graph_max_tokens", "overlap_schedule",
)  # fmt: skip
# Union alternatives show up in an error's location ("stop", "list[str]", 0); they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class SSEResponse(Response):
    """A server-sent-event stream, sent chunk by chunk. It always closes its body iterator, so an abandoned stream
    aborts its jobs at once; disconnects are watched by the request's Generation, not by a task per chunk."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes]):
        self.status_code = 200
        self.background = None
        self.body_iterator = body
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no body: no Content-Length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke under a write
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _error(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    if not parts:
        return None
    return str(parts[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[1:])


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]  # FastAPI raises it with at least one
    kind = err.get("type")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    param = _param(tuple(err.get("loc", ())))
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {err['msg']}")
    if kind == "missing":
        message = "this field is required"
    elif kind == "extra_forbidden":  # OpenAI's own wording, then what to do
        return APIError(
            400,
            f"Unrecognized request argument supplied: {param} (this server does not know this field; remove it; "
            "docs/serving.md lists the fields it takes)",
            param=param,
        )
    elif param.startswith("prompt") and kind != "value_error":
        param = "prompt"
        message = "expected a string, a list of strings, a list of token ids or a list of token-id lists"
    elif kind == "value_error":
        message = str(err["msg"]).removeprefix("Value error, ")
    else:
        got = repr(err.get("input"))
        message = f"{err['msg']} (got {got if len(got) <= 80 else got[:77] + '...'})"
    return APIError(400, f"{param}: {message}", param=param)


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    """Every error, in OpenAI's shape."""
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, RequestValidationError):
        error = _validation_error(exc)
    elif isinstance(exc, ValidationError | BodyError):
        error = APIError(400, f"{exc.field}: {exc.message}", param=exc.field)
    elif isinstance(exc, StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type_)
    else:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
    return _error(error)


class RequestGuard:
    """ASGI middleware that runs before any route parses a body. With ``--api-key`` the key is checked from the
    headers alone (401 before a byte of the body is read; /health and /metrics stay open, /docs does not); a body
    over ``--max-request-bytes`` is refused (413) as soon as its declared or counted size passes the limit, so one
    big request costs neither memory nor event-loop time that other requests wait for; a body that is not JSON by
    its Content-Type is refused (415) unread. The HTTP server discards the rest of a refused body as it arrives, so
    the client still gets to read the answer."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_bytes = max_bytes
        self.limit = (
            f"this server's limit of {max_bytes:,} bytes (--max-request-bytes); send a shorter prompt or conversation"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            authorization = headers.get("authorization", "")
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                what = "missing" if not authorization else "incorrect"
                problem = f"{what} API key; send 'Authorization: Bearer <key>'"
                return await _error(APIError(401, problem, code="invalid_api_key"))(scope, receive, send)
        declared = headers.get("content-length")
        if declared is None and "chunked" not in headers.get("transfer-encoding", "").lower():
            return await self.app(scope, receive, send)  # no body
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            problem = f"the request body is {int(declared):,} bytes, over {self.limit}"
            return await _error(APIError(413, problem, code="request_too_large"))(scope, receive, send)
        unreadable = _content_type_problem(headers.get("content-type"))
        if unreadable is not None and declared != "0":
            return await _error(APIError(415, unreadable, code="unsupported_media_type"))(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # the client left while sending: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                problem = f"the request body is over {self.limit}"
                return await _error(APIError(413, problem, code="request_too_large"))(scope, receive, send)
            more = message.get("more_body", False)
        await self.app(scope, replay_body(b"".join(chunks), receive), send)


def _content_type_problem(content_type: str | None) -> str | None:
    """Why a body of ``content_type`` is refused, or None: bodies are JSON, sent as ``application/json`` or
    ``application/*+json`` (every OpenAI client says so; a body without a Content-Type is refused too)."""
    if content_type is None:
        return (
            "the request body is sent without a Content-Type; this server reads JSON bodies only: send "
            "'Content-Type: application/json'"
        )
    kind = content_type.partition(";")[0].strip().lower()
    major, _, minor = kind.partition("/")
    if major == "application" and (minor == "json" or minor.endswith("+json")):
        return None
    shown = content_type if len(content_type) <= 80 else content_type[:77] + "..."
    return (
        f"the request body is sent as Content-Type {shown!r}; this server reads JSON bodies only: send "
        "'Content-Type: application/json'"
    )


def create_app(
    settings: ServeSettings,
    addresses: dict[str, str],
    info: dict[str, Any],
    workers: Launcher,
    *,
    text: TextTools | None = None,
) -> FastAPI:
    """The application for one server, whose worker processes ``workers`` watches. ``text`` serves
    /tokenize and /detokenize; by default the model's tokenizer, loaded in the background when the app starts."""
    from ..utils.model_path import parse_hub_id

    model_name = settings.model_name
    names = {model_name}  # and a Hub id as given to --model, with and without its @revision (as clients send it)
    hub = parse_hub_id(settings.model) if not settings.served_model_name else None
    if hub is not None:
        names |= {settings.model, hub[0]}
    metrics = ServerMetrics(model_name, kv_cache_dtype=str(info.get("kv_cache_dtype") or "unknown"))
    client = EngineClient(addresses, metrics, workers.tokenizers)
    max_model_len = int(info["max_model_len"]) if info.get("max_model_len") else None
    vocab_size = int(info["vocab_size"]) if info.get("vocab_size") else None
    model = settings.model

    def load_tokenizer() -> Any:
        with loading_quietly():  # in the background, while serving: no collection's pause, and frozen after
            return load_model_tokenizer(model)

    tools = text or TextTools(load_tokenizer, max_model_len, vocab_size)
    # The tool-call format: from the chat template, unless a serve setting names one.
    choose_parser(None, settings.tool_call_parser)  # an unknown name fails here, at start-up
    parsers: list[str] = []  # the chosen one, once known

    async def tool_parser() -> str:
        if not parsers:
            parsers.append(choose_parser(await tools.chat_template(), settings.tool_call_parser))
        return parsers[0]

    async def watch_workers(app: FastAPI) -> None:
        while (reason := workers.check()) is None:
            await asyncio.sleep(0.2)
        logger.error("%s; shutting down", reason)
        client.fail_all(reason)
        app.state.exit_code = 1
        await asyncio.sleep(1.0)  # let the 503 answers go out
        if app.state.server is not None:
            app.state.server.should_exit = True

    async def drain(grace: float) -> None:
        """Let the requests in flight finish for ``grace`` seconds, then end the rest with an error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if client.in_flight:
            logger.info("shutting down: waiting up to %g s for %d requests in flight", grace, client.in_flight)
        while client.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if client.in_flight:
            logger.warning("shutting down: ending %d requests still running after %g s", client.in_flight, grace)
            client.fail_all("the server is shutting down")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        await client.start(TokenizerLimits(max_model_len, vocab_size) if max_model_len and vocab_size else None)
        tools.start()
        watcher = asyncio.create_task(watch_workers(app))

        def start_drain() -> None:
            if not app.state.draining:
                app.state.draining = True
                app.state.drainer = asyncio.create_task(drain(settings.shutdown_timeout))

        app.state.begin_drain = lambda: loop.call_soon_threadsafe(start_drain)  # called from a signal handler
        yield
        watcher.cancel()
        tools.close()
        await client.close()

    app = FastAPI(title="minisgl", version=VERSION, lifespan=lifespan)
    app.state.exit_code = 0
    app.state.server = None
    app.state.draining = False
    app.state.client = client
    app.add_middleware(RouterFields)  # added first, so it runs inside the guard, on a body within the limit
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_bytes=settings.max_request_bytes)

    for kind in (APIError, RequestValidationError, ValidationError, BodyError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _on_error)

    def check_model(name: str | None, what: str = "the model") -> None:
        if name is not None and name not in names:
            message = f"{what} '{name}' does not exist; this server serves '{model_name}'"
            raise APIError(404, message, "not_found_error", param="model", code="model_not_found")

    def check(body: ChatCompletionRequest | CompletionRequest, prompts: int = 1) -> None:
        check_model(body.model)
        body.check_supported()
        body.check_vocab(vocab_size)
        if body.n > settings.max_n:
            raise ValidationError(
                "n", f"this server gives at most {settings.max_n} choices per prompt (--max-n), got {body.n}"
            )
        if prompts > settings.max_prompts:
            raise ValidationError(
                "prompt",
                f"this server takes at most {settings.max_prompts} prompts per request (--max-prompts), got "
                f"{prompts}; send them in several requests",
            )

    async def respond(
        request: Request, jobs: list[Job], shape: ResponseShape, stream: bool, field: str, grammar: str | None
    ) -> Response:
        if app.state.draining:
            raise gone_error("the server is shutting down")
        # A grammar the engine cannot compile is reported against the request field that sent it.
        fields = {"prompt": field, **({"grammar": grammar, "response_format": grammar} if grammar else {})}
        gen = Generation(client, request.receive, jobs, fields)
        try:
            await gen.start()
            return SSEResponse(stream_events(gen, shape)) if stream else JSONResponse(await collect(gen, shape))
        except ServerGone as exc:
            raise gone_error(str(exc)) from None
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check(body)
        messages, template_tools = body.plain_messages(), body.template_tools()
        grammar, grammar_field = body.grammar()
        mode, named = body.tool_mode()
        functions = [t.function.name for t in body.tools or []]
        # Auto tools are parsed from the output, unless a response_format's JSON is asked for.
        parser = await tool_parser() if mode == "auto" and grammar is None else None
        jobs = []
        for i in range(body.n):
            req = GenerateReq(client.new_rid(), body.params(i).to_dict(), messages=messages, tools=template_tools)
            job = Job(req, i, 0)
            if mode in ("required", "named"):
                job.tools = ForcedStream(named, functions)
            elif parser is not None:
                job.tools = make_stream(parser, functions, body.parallel_tool_calls is not False)
            jobs.append(job)
        shape = ResponseShape(True, model_name, body.logprobs, body.include_usage)
        return await respond(request, jobs, shape, body.stream, "messages", grammar_field)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = body.prompts()
        check(body, len(prompts))
        jobs = []
        for pi, prompt in enumerate(prompts):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            for i in range(body.n):
                req = GenerateReq(client.new_rid(), body.params(i).to_dict(), text=text, input_ids=ids)
                jobs.append(Job(req, pi * body.n + i, pi))
        shape = ResponseShape(False, model_name, body.logprobs is not None, body.include_usage)
        return await respond(request, jobs, shape, body.stream, "prompt", body.grammar()[1])

    card = {
        "id": model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "minisgl",
        "root": settings.model,
        "max_model_len": info.get("max_model_len"),
        "minisgl": {key: info.get(key) for key in _ENGINE_KEYS},
    }

    add_router_routes(app, model_name, info)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        check_model(model_id, "The model")
        return card

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        source = body.source()
        special = body.add_special_tokens if body.add_special_tokens is not None else isinstance(source, str)
        generation_prompt = body.add_generation_prompt is not False
        ids, strs = await tools.tokenize(
            source, special, generation_prompt, body.return_token_strs, body.template_tools()
        )
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        return {"prompt": await tools.detokenize(body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        report = workers.health(settings.health_timeout, settings.stall_timeout)
        metrics.update(report.scheduler)
        problem = "the server is shutting down" if app.state.draining else report.problem
        if problem is not None:
            return _error(APIError(503, f"not ready: {problem}", "server_error", code="service_unavailable"))
        state = report.scheduler
        running, waiting = state.get("running", 0), state.get("waiting", 0)
        return JSONResponse({"status": "ok", "model": model_name, "running": running, "waiting": waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        # The gauges come from the scheduler's last heartbeat (at most half a second old).
        metrics.update(workers.health(settings.health_timeout, settings.stall_timeout).scheduler)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
