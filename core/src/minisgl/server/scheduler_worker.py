"""The scheduler process: tensor-parallel rank 0, the one that talks to the other workers.

It builds the engine and scheduler exactly as :class:`minisgl.LLM` does (with
``tp`` > 1 it starts the other ranks as its own child processes, which replay
its every step; see :mod:`minisgl.scheduler.tp`), then
loops: take every queued message, run one scheduler step when there is work,
send what the iteration produced (queued and refused requests, sampled tokens)
to the detokenizer as one columnar :class:`~minisgl.message.StepOutput`. With
no work it blocks on its socket, so an idle server uses no CPU. Stop strings
are the detokenizer's business: it sends a :class:`~minisgl.message.StopReq`
when one ends a request.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..message import AbortReq, StepOutput, StopReq, TokenizedReq, encode, recv_all
from .process import ParentWatch, unpack_args, worker_process


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
        sched, kv = self.sched, self.sched.kv
        cached = int(kv.cache_pages)
        self.state = {
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "kv_pages_used": int(kv.used_pages) - cached,
            "kv_pages_cached": cached,
            "kv_pages_total": int(kv.usable_pages),
        }
        if became_idle:
            self.beat_now()

    def probe(self) -> tuple[float, dict[str, Any]]:
        started = self.step_started
        return (time.monotonic() - started if started is not None else 0.0), self.state


def scheduler_main(launch: bytes) -> None:
    """Entry point of a scheduler process (see :mod:`minisgl.server.launcher`)."""
    args = unpack_args(launch)
    addr = args["addresses"]
    rank = int(args.get("rank", 0))
    with worker_process(f"scheduler-{rank}", addr["status"]) as (ctx, status):
        if rank != 0:
            raise ValueError("the launcher starts rank 0 only; rank 0 starts the other tensor-parallel ranks")
        # SIGTERM (from the launcher) ends the loop between steps, so tensor-parallel ranks are stopped cleanly.
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
        sched, ranks = _build_scheduler(args["engine"])
        engine = sched.engine
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(addr["scheduler"])
        outbox = ctx.socket(zmq.PUSH)
        outbox.connect(addr["detokenizer"])
        status.ready(
            architecture=engine.architecture,
            max_model_len=int(engine.max_model_len),
            vocab_size=int(sched.vocab_size),
            kv_pages=int(sched.kv.usable_pages),
            page_size=int(engine.config.page_size),
            device=str(engine.device),
            tp=int(engine.config.tp),
            max_running_requests=int(engine.config.max_running_requests),
            chunked_prefill_size=int(engine.config.chunked_prefill_size),
            attention_backend=",".join(spec.name for spec in engine.attn_specs),
            prefix_cache=type(sched.kv.cache).__name__,
            cuda_graphs=engine.graphs is not None,
            overlap_schedule=bool(sched.overlap),
        )
        progress = _Progress(sched, status.beat_now)
        status.start_heartbeat(progress.probe)
        watch = ParentWatch()
        try:
            _serve(sched, ranks, inbox, outbox, watch, stopping, progress)
        finally:
            if ranks is not None:
                _stop_ranks(sched, ranks)


def _build_scheduler(fields: dict[str, Any]) -> tuple[Any, Any]:
    """Rank 0's scheduler, as :class:`minisgl.LLM` builds it (less stop strings), and the other ranks (tp > 1)."""
    from ..config import EngineConfig
    from ..engine import Engine
    from ..models import eos_token_ids, load_tokenizer
    from ..scheduler import Scheduler

    config = EngineConfig(**fields)
    if config.tp > 1:
        from ..plugins import load_plugins
        from ..scheduler.tp import start_tensor_parallel

        sched, ranks, _ = start_tensor_parallel(config, load_plugins(config.plugins, paths=config.plugin_paths))
        sched.detokenize = None  # stop strings are the detokenizer process's to find
        return sched, ranks
    engine = Engine(config)
    tokenizer = load_tokenizer(engine.source) if engine.source is not None else None
    eos = eos_token_ids(engine.hf_config, tokenizer, engine.source)
    return Scheduler(engine, eos_token_ids=eos, tokenizer=tokenizer), None  # the tokenizer compiles grammars


def _stop_ranks(sched: Any, ranks: Any) -> None:
    ranks.shutdown(sched, timeout=10.0)


def _serve(
    sched: Any,
    ranks: Any,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    watch: ParentWatch,
    stopping: list[int],
    progress: _Progress,
) -> None:
    """The request loop: take every queued message, run one step, send what happened."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while not stopping:
        if watch.due():
            if watch.parent_gone():
                return
            if ranks is not None:
                ranks.check_alive()  # a dead rank would hang the next collective: fail now instead
        out = StepOutput()
        if poller.poll(0 if sched.has_work else 200):
            _take(sched, recv_all(inbox), out)
        if sched.has_work:
            progress.step_started = time.monotonic()
            try:
                events = sched.step()
            except RuntimeError:
                if ranks is not None:
                    ranks.check_alive(grace=5.0)  # name the rank that is gone, if one is
                raise
            finally:
                progress.step_started = None
            if events:
                _add_events(out, events)
        progress.refresh()
        if out.rids or out.accepted or out.failed or out.dropped:
            outbox.send(encode(out))


def _take(sched: Any, messages: list[Any], out: StepOutput) -> None:
    """Queue new requests, abort and stop others; record the outcome in ``out``."""
    from ..core import SamplingParams, ValidationError

    for msg in messages:
        if isinstance(msg, TokenizedReq):
            try:
                req = sched.add_request(msg.input_ids, SamplingParams.from_dict(msg.params), rid=msg.rid)
            except ValidationError as exc:
                out.failed.append([msg.rid, exc.field, exc.message])
            else:
                p = req.params
                out.accepted.append(
                    [req.rid, req.prompt_len, list(p.stop_strings), p.skip_special_tokens, p.logprobs is not None]
                )
        elif isinstance(msg, AbortReq):
            if sched.abort(msg.rid) is not None:
                out.dropped.append(msg.rid)
        elif isinstance(msg, StopReq):
            sched.abort(msg.rid, "stop")  # the detokenizer already finished it


def _add_events(out: StepOutput, events: list[Any]) -> None:
    """The step's token events, as columns."""
    rids, tokens, finished = out.rids, out.tokens, out.finished
    logprobs: list[Any] | None = None
    for i, ev in enumerate(events):
        req = ev.req
        token = int(ev.token)
        rids.append(req.rid)
        tokens.append(token)
        if ev.finished:
            reason = req.finish_reason
            stop_token = reason == "stop" and (token in req.eos_token_ids or token in req.params.stop_ids)
            finished.append([i, reason, stop_token, int(req.prefix_len)])
        if ev.logprob is not None:
            if logprobs is None:
                logprobs = [None] * i
            logprobs.append([float(ev.logprob.logprob), [[int(t), float(lp)] for t, lp in ev.logprob.top]])
        elif logprobs is not None:
            logprobs.append(None)
    out.logprobs = logprobs
