"""The worker processes (scheduler rank 0, tokenizers, detokenizer) and what they share.

Workers are spawned (never forked) with one msgpack-encoded dict of plain values. Each reports "ready" or "error"
(with the message a user should see) to the launcher's status socket, sends heartbeats, ignores SIGINT (Ctrl-C
reaches the whole process group; the launcher decides) and exits on its own when the launcher disappears.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from ..message import (
    AbortReq,
    GenerateReq,
    Heartbeat,
    StepOutput,
    StopReq,
    TokenizedReq,
    TokenizerLimits,
    WorkerStatus,
    decode,
    encode,
    recv_all,
)
from ..utils.heap import settle_heap, watch_gc_pauses


def user_error(exc: BaseException) -> str:
    """The one-line message to show for a start-up failure."""
    from ..core import ValidationError

    if isinstance(exc, ValidationError):
        return f"invalid {exc.field}: {exc.message}"
    text = str(exc) or type(exc).__name__
    # Errors meant for users carry their own wording; anything else gets its type for context.
    if type(exc).__name__ in ("ModelLoadError", "UnknownComponentError", "PluginError"):
        return text
    lowered = text.lower()
    if isinstance(exc, MemoryError) or any(s in lowered for s in ("out of memory", "not enough memory", "allocate")):
        return f"out of memory: {text}"
    return f"{type(exc).__name__}: {text}"


Probe = Callable[[], tuple[float, dict[str, Any]]]  # (seconds inside the current step, gauges) for a heartbeat


class StatusReporter:
    """Sends :class:`WorkerStatus` messages and, once ready, heartbeats to the launcher."""

    def __init__(self, ctx: zmq.Context, address: str, worker: str):
        self.worker = worker
        self.ctx = ctx
        self.address = address
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beat: threading.Thread | None = None

    def ready(self, info: dict[str, Any] | None = None, probe: Probe | None = None) -> None:
        """Report ready, then send a :class:`Heartbeat` (of ``probe()``) every half second from a thread of its own,
        which runs while the main thread is inside a long computation (kernels release the GIL) and stops with the
        process, so a stopped or dead worker falls silent. Start-up's objects are frozen first (settle_heap)."""
        settle_heap()
        watch_gc_pauses(self.worker)  # from now on: start-up's own collections are expected to be long
        self.sock.send(encode(WorkerStatus(self.worker, "ready", info=info or {})))
        name = f"{self.worker}-heartbeat"
        self._beat = threading.Thread(target=self._heartbeat, args=(probe,), name=name, daemon=True)
        self._beat.start()

    def _heartbeat(self, probe: Probe | None) -> None:
        sock = self.ctx.socket(zmq.PUSH)  # a socket of its own: zmq sockets are not thread-safe
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stop.is_set():
                self._wake.wait(0.5)
                self._wake.clear()
                if self._stop.is_set():
                    break
                busy, state = probe() if probe is not None else (0.0, {})
                with contextlib.suppress(zmq.Again):  # the launcher is not reading: skip this beat
                    sock.send(encode(Heartbeat(self.worker, busy, state)), zmq.NOBLOCK)
        except zmq.ZMQError:  # the context is going away with the process
            pass
        finally:
            sock.close(0)

    def beat_now(self) -> None:
        """Send the next heartbeat at once (the state just changed in a way watchers care about)."""
        self._wake.set()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._beat is not None:
            self._beat.join(2.0)


class _Stopped(Exception):
    """SIGTERM from the launcher, raised where the worker is."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped()


@contextlib.contextmanager
def worker_process(launch: bytes) -> Iterator[tuple[dict[str, Any], zmq.Context, StatusReporter]]:
    """Run a worker's body on its decoded launch arguments: report an exception to the launcher and exit non-zero.
    SIGTERM ends the body and the process exits normally: a process the default handler ends runs no finalizer,
    and a multiprocessing lock it made (tqdm makes one, e.g. while a GGUF file is converted) would leak its
    semaphore. The scheduler sets a handler of its own, which stops its loop between steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_stopped)
    args = decode(launch)
    ctx = zmq.Context()
    reporter = StatusReporter(ctx, args["addresses"]["status"], args["name"])
    try:
        yield args, ctx, reporter
    except _Stopped:
        pass
    except BaseException as exc:  # every failure must reach the launcher, whatever its type
        try:
            detail = "".join(traceback.format_exception(exc))
            reporter.sock.send(encode(WorkerStatus(args["name"], "error", error=user_error(exc), detail=detail)))
        finally:
            traceback.print_exc(file=sys.stderr)
        sys.exit(1)  # after the clean-up below
    finally:
        reporter.stop_heartbeat()
        ctx.destroy(linger=2000)


def _sockets(ctx: zmq.Context, addresses: dict[str, str], inbox: str, *outboxes: str) -> list[zmq.Socket]:
    """A PULL socket bound at ``inbox``, then a PUSH socket connected to each of ``outboxes``."""
    socks = [ctx.socket(zmq.PULL)]
    socks[0].bind(addresses[inbox])
    for name in outboxes:
        socks.append(ctx.socket(zmq.PUSH))
        socks[-1].connect(addresses[name])
    return socks


def _serve_inbox(inbox: zmq.Socket, handle: Callable[[Any], None]) -> None:
    """Hand every message arriving on ``inbox`` to ``handle`` until the launcher is gone (this process re-parented)."""
    parent = os.getppid()
    while os.getppid() == parent:
        if inbox.poll(200):
            for msg in recv_all(inbox):
                handle(msg)


def _model_tokenizer(model: str) -> Any:
    from ..models import ModelSource, load_tokenizer

    return load_tokenizer(ModelSource.from_path(model))


# ------------------------------------------------------------------ tokenizer and detokenizer processes
def tokenizer_main(launch: bytes) -> None:
    """Entry point of a tokenizer process: requests in, token ids to the scheduler."""
    from ..tokenizer.worker import TokenizerService

    with worker_process(launch) as (args, ctx, status):
        service = TokenizerService(_model_tokenizer(args["model"]))
        inbox, to_sched, to_api = _sockets(ctx, args["addresses"], args["name"], "scheduler", "api")
        status.ready()

        def handle(msg: Any) -> None:
            if isinstance(msg, GenerateReq):
                result = service.tokenize(msg)
                (to_sched if isinstance(result, TokenizedReq) else to_api).send(encode(result))
            elif isinstance(msg, AbortReq):
                to_sched.send(encode(msg))  # behind its request on the same socket
            elif isinstance(msg, TokenizerLimits):
                service.limits = msg

        _serve_inbox(inbox, handle)


def detokenizer_main(launch: bytes) -> None:
    """Entry point of the detokenizer process: token ids in, text to the API server, stop strings found."""
    from ..tokenizer.detokenizer import DetokenizerService

    with worker_process(launch) as (args, ctx, status):
        service = DetokenizerService(_model_tokenizer(args["model"]))
        inbox, to_api, to_sched = _sockets(ctx, args["addresses"], "detokenizer", "api", "scheduler")
        status.ready()

        def handle(msg: Any) -> None:
            if not isinstance(msg, StepOutput):
                return
            batch, stopped = service.process(msg)
            if batch.rids or batch.failed:
                to_api.send(encode(batch))
            for rid in stopped:
                to_sched.send(encode(StopReq(rid)))

        _serve_inbox(inbox, handle)


# ------------------------------------------------------------------ the scheduler process
class _Progress:
    """What the heartbeat thread reports: time inside the current step, and gauges refreshed between steps."""

    def __init__(self, sched: Any, beat_now: Callable[[], None]):
        self.sched = sched
        self.beat_now = beat_now
        self.step_started: float | None = None
        self.state: dict[str, Any] = {}
        self._next = 0.0
        self._idle = True
        self.refresh()

    def refresh(self) -> None:
        """Refresh the gauges every 0.2 s while busy, and at once (with a heartbeat) on becoming idle."""
        now = time.monotonic()
        idle = not self.sched.has_work
        became_idle = idle and not self._idle
        self._idle = idle
        if not became_idle and now < self._next:
            return
        self._next = now + 0.2
        kv = self.sched.kv
        cached = int(kv.cache_pages)
        self.state = {
            "running": self.sched.num_running,
            "waiting": self.sched.num_waiting,
            "compiling": self.sched.num_compiling,
            "kv_pages_used": int(kv.used_pages) - cached,
            "kv_pages_cached": cached,
            "kv_pages_total": int(kv.usable_pages),
            "kv_pages_free": int(kv.free_pages),
            "kv_pages_reserved": int(kv.reserved_pages),
            "preemptions": int(self.sched.stats["preemptions"]),
        }
        if became_idle:
            self.beat_now()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The loop is working (a step, or taking requests): the heartbeat reports for how long."""
        self.step_started = time.monotonic()
        try:
            yield
        finally:
            self.step_started = None

    def probe(self) -> tuple[float, dict[str, Any]]:
        started = self.step_started
        return (time.monotonic() - started if started is not None else 0.0), self.state


def scheduler_main(launch: bytes) -> None:
    """Entry point of the scheduler process: builds the engine as :class:`minisgl.LLM` does (with ``tp`` > 1 it
    starts the other ranks as its children, which replay its every step), then serves requests until stopped."""
    with worker_process(launch) as (args, ctx, status):
        # SIGTERM (from the launcher) ends the loop between steps, so tensor-parallel ranks are stopped cleanly.
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
        sched, ranks = _build_scheduler(args["engine"])
        engine, config = sched.engine, sched.engine.config
        from ..kvcache import kv_dtype_name

        inbox, outbox = _sockets(ctx, args["addresses"], "scheduler", "detokenizer")
        progress = _Progress(sched, status.beat_now)
        info = {
            "architecture": engine.architecture,
            "max_model_len": int(engine.max_model_len),
            "vocab_size": int(sched.vocab_size),
            "kv_pages": int(sched.kv.usable_pages),
            "page_size": int(config.page_size),
            "kv_cache_dtype": kv_dtype_name(engine.kv_dtype),
            "device": str(engine.device),
            "tp": int(config.tp),
            "max_running_requests": int(config.max_running_requests),
            "chunked_prefill_size": int(config.chunked_prefill_size),
            "attention_backend": ",".join(spec.name for spec in engine.attn_specs),
            "prefix_cache": type(sched.kv.cache).__name__,
            "cuda_graphs": engine.graphs is not None,
            "prefill_graph_max_tokens": engine.prefill_graph_max_tokens,
            "overlap_schedule": bool(sched.overlap),
        }
        status.ready(info, progress.probe)
        try:
            _serve(sched, ranks, inbox, outbox, stopping, progress)
        finally:
            sched.close()  # the step trace's last lines
            if ranks is not None:
                ranks.shutdown(sched, timeout=10.0)


def _build_scheduler(fields: dict[str, Any]) -> tuple[Any, Any]:
    """Rank 0's scheduler, as :class:`minisgl.LLM` builds it (less stop strings), and the other ranks (tp > 1)."""
    from ..config import EngineConfig
    from ..scheduler.tp import start_scheduler

    sched, ranks, _ = start_scheduler(EngineConfig(**fields))
    sched.detokenize = None  # stop strings are the detokenizer process's to find; the tokenizer compiles grammars
    return sched, ranks


def _serve(
    sched: Any, ranks: Any, inbox: zmq.Socket, outbox: zmq.Socket, stopping: list[int], progress: _Progress
) -> None:
    """The request loop: take every queued message, run one step when there is work, send what happened to the
    detokenizer as one columnar StepOutput. With no work it blocks on its socket, so an idle server uses no CPU."""
    from ..scheduler.tp import step_naming_dead_rank

    parent = os.getppid()
    next_check = 0.0
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while not stopping:
        if time.monotonic() >= next_check:  # twice a second: checking the ranks is cheap but not free
            next_check = time.monotonic() + 0.5
            if os.getppid() != parent:  # the launcher is gone
                return
            if ranks is not None:
                ranks.check_alive()  # a dead rank would hang the next collective: fail now instead
        out = StepOutput()
        if poller.poll(0 if sched.has_work else 200):
            with progress.busy():  # what the loop does outside a step counts too
                _take(sched, recv_all(inbox), out)
        if sched.has_work:
            with progress.busy():
                events = step_naming_dead_rank(sched, ranks)
            _grammar_outcomes(sched, out)
            if events:
                _add_events(out, events)
        progress.refresh()
        if out.rids or out.accepted or out.failed or out.dropped:
            outbox.send(encode(out))


def _take(sched: Any, messages: list[Any], out: StepOutput) -> None:
    """Queue new requests, abort and stop others; record the outcome in ``out``."""
    from ..core import ReqStatus, SamplingParams, ValidationError

    for msg in messages:
        if isinstance(msg, TokenizedReq):
            try:
                req = sched.add_request(msg.input_ids, SamplingParams.from_dict(msg.params), rid=msg.rid)
            except ValidationError as exc:
                out.failed.append([msg.rid, exc.field, exc.message])
            else:
                if req.status is not ReqStatus.COMPILING:  # else accepted once its grammar compiled
                    _accepted(req, out)
        elif isinstance(msg, AbortReq):
            if sched.abort(msg.rid) is not None:
                out.dropped.append(msg.rid)
        elif isinstance(msg, StopReq):
            sched.abort(msg.rid, "stop")  # the detokenizer already finished it


def _accepted(req: Any, out: StepOutput) -> None:
    p = req.params
    out.accepted.append([req.rid, req.prompt_len, list(p.stop_strings), p.skip_special_tokens, p.logprobs is not None])


def _grammar_outcomes(sched: Any, out: StepOutput) -> None:
    """Requests whose grammar compiled (now accepted) or was refused (a 400 on the field that sent it)."""
    for req, exc in sched.take_grammar_outcomes():
        if exc is None:
            _accepted(req, out)
        else:
            out.failed.append([req.rid, exc.field, exc.message])


def _add_events(out: StepOutput, events: list[Any]) -> None:
    """The step's token events, as columns (``logprobs`` stays None when no event has any)."""
    logprobs: list[Any] = []
    for i, ev in enumerate(events):
        req = ev.req
        token = -1 if ev.token is None else int(ev.token)  # -1: it ended without a token
        out.rids.append(req.rid)
        out.tokens.append(token)
        if ev.finished:
            reason = req.finish_reason
            stop_token = reason == "stop" and (token in req.eos_token_ids or token in req.params.stop_ids)
            out.finished.append([i, reason, stop_token, int(req.prefix_len)])
        lp = ev.logprob
        logprobs.append(None if lp is None else [float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]])
    if any(entry is not None for entry in logprobs):
        out.logprobs = logprobs
