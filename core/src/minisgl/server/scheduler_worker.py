"""The scheduler process: tensor-parallel rank 0, the one that talks to the tokenizer.

It builds the engine and scheduler exactly as :class:`minisgl.LLM` does (with
``tp`` > 1 it starts the other ranks as its own child processes, which replay
its every step; see :mod:`minisgl.scheduler.tp`), then
loops: take every queued message, run one scheduler step when there is work,
send that step's token events to the detokenizer. With no work it blocks on
its socket, so an idle server uses no CPU.
"""

from __future__ import annotations

import signal
from typing import Any

import zmq

from ..message import (
    AbortReq,
    Accepted,
    RequestFailed,
    Stats,
    StatsReq,
    StepOutput,
    TokenEventMsg,
    TokenizedReq,
    encode,
    recv_all,
)
from .process import ParentWatch, unpack_args, worker_process


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
            kv_pages=int(engine.kv.usable_pages),
            page_size=int(engine.config.page_size),
            device=str(engine.device),
            tp=int(engine.config.tp),
        )
        watch = ParentWatch()
        try:
            _serve(sched, ranks, inbox, outbox, watch, stopping)
        finally:
            if ranks is not None:
                _stop_ranks(sched, ranks)


def _build_scheduler(fields: dict[str, Any]) -> tuple[Any, Any]:
    """Rank 0's scheduler, as :class:`minisgl.LLM` builds it, and the other ranks' processes (tp > 1)."""
    from ..engine import Engine
    from ..models import eos_token_ids, load_tokenizer
    from ..scheduler import Scheduler
    from .engine_build import engine_config

    config = engine_config(fields)
    if config.tp > 1:
        from ..plugins import load_plugins
        from ..scheduler.tp import start_tensor_parallel

        sched, ranks, _ = start_tensor_parallel(config, load_plugins(config.plugins))
        return sched, ranks
    engine = Engine(config)
    tokenizer = load_tokenizer(engine.source) if engine.source is not None else None
    eos = eos_token_ids(engine.hf_config, tokenizer, engine.source)
    detok = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None
    return Scheduler(engine, eos_token_ids=eos, detokenize=detok), None


def _stop_ranks(sched: Any, ranks: Any) -> None:
    ranks.shutdown(sched, timeout=10.0)


def _serve(
    sched: Any, ranks: Any, inbox: zmq.Socket, outbox: zmq.Socket, watch: ParentWatch, stopping: list[int]
) -> None:
    """The request loop: take every queued message, run one step, send its token events."""
    from ..core import SamplingParams, ValidationError

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while not stopping:
        if watch.due():
            if watch.parent_gone():
                return
            if ranks is not None:
                ranks.check_alive()  # a dead rank would hang the next collective: fail now instead
        if poller.poll(0 if sched.has_work else 200):
            for msg in recv_all(inbox):
                if isinstance(msg, TokenizedReq):
                    try:
                        params = SamplingParams.from_dict(msg.params)
                        req = sched.add_request(msg.input_ids, params, rid=msg.rid)
                    except ValidationError as exc:
                        outbox.send(encode(RequestFailed(msg.rid, exc.field, exc.message)))
                    else:
                        outbox.send(encode(Accepted(msg.rid, req.prompt_len)))
                elif isinstance(msg, AbortReq):
                    sched.abort(msg.rid)
                elif isinstance(msg, StatsReq):
                    outbox.send(encode(_stats(sched, msg.token)))
        if sched.has_work:
            try:
                events = sched.step()
            except RuntimeError:
                if ranks is not None:
                    ranks.check_alive(grace=5.0)  # name the rank that is gone, if one is
                raise
            if events:
                outbox.send(encode(StepOutput([_event(e) for e in events])))


def _event(ev: Any) -> TokenEventMsg:
    req = ev.req
    token = int(ev.token)
    msg = TokenEventMsg(
        rid=req.rid,
        token=token,
        finished=bool(ev.finished),
        finish_reason=req.finish_reason if ev.finished else None,
        stop_token=bool(
            ev.finished and req.finish_reason == "stop" and (token in req.eos_token_ids or token in req.params.stop_ids)
        ),
        cached_tokens=int(req.prefix_len),
    )
    if ev.logprob is not None:
        msg.logprob = float(ev.logprob.logprob)
        msg.top = [[int(t), float(lp)] for t, lp in ev.logprob.top]
    return msg


def _stats(sched: Any, token: int) -> Stats:
    kv = sched.engine.kv
    cached = int(kv.cache_pages)
    return Stats(
        token=token,
        running=sched.num_running,
        waiting=sched.num_waiting,
        kv_pages_used=int(kv.used_pages) - cached,
        kv_pages_cached=cached,
        kv_pages_total=int(kv.usable_pages),
        page_size=int(kv.page_size),
        max_model_len=int(sched.engine.max_model_len),
    )
