"""The FastAPI application: OpenAI routes, /health, /metrics, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..core import SamplingParams, ValidationError
from ..message import GenerateReq, TokenizerLimits
from ..utils import VERSION
from .client import EngineClient, ServerGone
from .limits import RequestGuard, RequestLimits
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import APIError, ClientGone, Generation, Job, ResponseShape, collect, gone_error, stream_events
from .settings import ServeSettings
from .text_tools import TextTools, load_model_tokenizer
from .tools import CallStream, ForcedStream, choose_parser, make_stream

if TYPE_CHECKING:
    from .launcher import Health

logger = logging.getLogger("minisgl.server")


class SSEResponse(Response):
    """A server-sent-event stream, sent chunk by chunk; always closes its body iterator, so an
    abandoned stream aborts its jobs at once. Disconnects are watched by the request's
    :class:`~minisgl.server.serving.Generation`, not by a task of the response per chunk."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str]):
        self.status_code = 200
        self.background = None
        self.body_iterator = body
        self.init_headers(headers)  # no body attribute: no Content-Length

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
    if err.get("type") == "extra_forbidden":
        # OpenAI's own wording, then what to do.
        return APIError(
            400,
            f"Unrecognized request argument supplied: {param} (this server does not know this field; remove it; "
            "docs/serving.md lists the fields it takes)",
            param=param,
        )
    if param.startswith("prompt") and err.get("type") != "value_error":
        message = "expected a string, a list of strings, a list of token ids or a list of token-id lists"
        return APIError(400, f"prompt: {message}", param="prompt")
    if err.get("type") == "value_error":
        return APIError(400, f"{param}: {str(err['msg']).removeprefix('Value error, ')}", param=param)
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return APIError(400, f"{param}: {err['msg']} (got {got})", param=param)


class WorkerMonitor(Protocol):
    """What the app needs of the launcher (see :class:`minisgl.server.launcher.Launcher`)."""

    tokenizers: list[str]

    def check(self) -> str | None:
        """Why the workers can no longer serve, or None."""

    def health(self, silence: float, stall: float) -> Health:
        """The workers' heartbeats, judged."""


def model_names(settings: ServeSettings) -> set[str]:
    """The names a request's ``model`` may use: the served name, and a Hub id as given to ``--model``
    (with and without its ``@revision``), as clients of other servers send it."""
    from ..utils.model_path import parse_hub_id

    names = {settings.model_name}
    hub = parse_hub_id(settings.model) if not settings.served_model_name else None
    if hub is not None:
        names |= {settings.model, hub[0]}
    return names


def create_app(
    settings: ServeSettings,
    addresses: dict[str, str],
    info: dict[str, Any],
    workers: WorkerMonitor,
    *,
    text: TextTools | None = None,
) -> FastAPI:
    """The application for one server, whose worker processes ``workers`` watches.

    ``text`` tokenizes for ``/tokenize`` and ``/detokenize``; by default the model's tokenizer,
    loaded in the background when the app starts.
    """
    model_name = settings.model_name
    names = model_names(settings)
    metrics = ServerMetrics(model_name)
    client = EngineClient(addresses, metrics, workers.tokenizers)
    max_model_len = int(info["max_model_len"]) if info.get("max_model_len") else None
    vocab_size = int(info["vocab_size"]) if info.get("vocab_size") else None
    if text is None:
        model = settings.model
        text = TextTools(lambda: load_model_tokenizer(model), max_model_len, vocab_size)
    tools = text
    # The tool-call format: from the chat template, unless a serve setting names one.
    parser_setting = settings.tool_call_parser
    choose_parser(None, parser_setting)  # an unknown name fails here, at start-up
    parsers: list[str] = []  # the chosen one, once known

    async def tool_parser() -> str:
        if not parsers:
            parsers.append(choose_parser(await tools.chat_template(), parser_setting))
        return parsers[0]

    async def watch_workers(app: FastAPI) -> None:
        while True:
            reason = workers.check()
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
        limits = None
        if info.get("max_model_len") and info.get("vocab_size"):
            limits = TokenizerLimits(int(info["max_model_len"]), int(info["vocab_size"]))
        await client.start(limits)
        tools.start()
        watcher = asyncio.create_task(watch_workers(app))

        def begin_drain() -> None:
            def start() -> None:
                if not app.state.draining:
                    app.state.draining = True
                    app.state.drainer = asyncio.create_task(drain(settings.shutdown_timeout))

            loop.call_soon_threadsafe(start)

        app.state.begin_drain = begin_drain
        yield
        watcher.cancel()
        tools.close()
        await client.close()

    app = FastAPI(title="minisgl", version=VERSION, lifespan=lifespan)
    app.state.exit_code = 0
    app.state.server = None
    app.state.draining = False
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
        if name is not None and name not in names:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{model_name}'",
                "not_found_error",
                param="model",
                code="model_not_found",
            )

    async def respond(
        request: Request,
        jobs: list[Job],
        shape: ResponseShape,
        stream: bool,
        field: str,
        grammar_field: str | None = None,
    ) -> Response:
        if app.state.draining:
            raise gone_error("the server is shutting down")
        # A grammar the engine cannot compile is reported against the request field that sent it.
        fields = {"grammar": grammar_field, "response_format": grammar_field} if grammar_field else None
        gen = Generation(client, request.receive, jobs, prompt_field=field, fields=fields)
        try:
            await gen.start()
            if stream:
                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                return SSEResponse(stream_events(gen, shape), headers=headers)
            return JSONResponse(await collect(gen, shape))
        except ServerGone as exc:
            raise gone_error(str(exc)) from None
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check_supported()
        body.check_vocab(vocab_size)
        limits.check_choices(body.n)
        messages = body.plain_messages()
        params: list[SamplingParams] = [body.params(i) for i in range(body.n)]
        template_tools = body.template_tools()
        jobs = [
            Job(GenerateReq(client.new_rid(), p.to_dict(), messages=messages, tools=template_tools), i, 0)
            for i, p in enumerate(params)
        ]
        grammar, grammar_field = body.grammar()
        mode, named = body.tool_mode()
        names = [t.function.name for t in body.tools or []]
        parallel = body.parallel_tool_calls is not False
        parser = await tool_parser() if mode == "auto" and grammar is None else None
        for job in jobs:
            stream: CallStream | None = None
            if mode in ("required", "named"):
                stream = ForcedStream(named, names)
            elif parser is not None:  # auto (a response_format wins: its JSON is not read as calls)
                stream = make_stream(parser, names, parallel)
            job.tools = stream
        shape = ResponseShape(True, model_name, body.logprobs, body.include_usage)
        return await respond(request, jobs, shape, body.stream, "messages", grammar_field)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check_supported()
        body.check_vocab(vocab_size)
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
        return await respond(request, jobs, shape, body.stream, "prompt", body.grammar()[1])

    card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "minisgl",
        "root": settings.model,
        "max_model_len": info.get("max_model_len"),
        # What the engine was built with (the same as the "model ready" log line), for clients and operators.
        "minisgl": {
            key: info.get(key)
            for key in (
                "architecture",
                "device",
                "tp",
                "attention_backend",
                "prefix_cache",
                "kv_pages",
                "page_size",
                "max_running_requests",
                "chunked_prefill_size",
                "cuda_graphs",
                "overlap_schedule",
            )
        },
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        if model_id not in names:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return card

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        source = body.source()
        chat = not isinstance(source, str)
        special = body.add_special_tokens if body.add_special_tokens is not None else not chat
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
