"""The tokenizer and detokenizer processes: sockets around the services in :mod:`minisgl.tokenizer`."""

from __future__ import annotations

from typing import Any

import zmq

from ..message import AbortReq, GenerateReq, StepOutput, StopReq, TokenizedReq, TokenizerLimits, encode
from ..tokenizer.detokenizer import DetokenizerService
from ..tokenizer.worker import TokenizerService
from .process import serve_inbox, unpack_args, worker_process


def tokenizer_main(launch: bytes) -> None:
    """Entry point of a tokenizer process: requests in, token ids to the scheduler."""
    args = unpack_args(launch)
    addr = args["addresses"]
    name = args["name"]
    with worker_process(name, addr["status"]) as (ctx, status):
        from ..models import ModelSource, load_tokenizer

        service = TokenizerService(load_tokenizer(ModelSource.from_path(args["model"])))
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(addr[name])
        to_sched = ctx.socket(zmq.PUSH)
        to_sched.connect(addr["scheduler"])
        to_api = ctx.socket(zmq.PUSH)
        to_api.connect(addr["api"])
        status.ready(has_tokenizer=service.tokenizer is not None)
        status.start_heartbeat()

        def handle(msg: Any) -> None:
            if isinstance(msg, GenerateReq):
                result = service.tokenize(msg)
                (to_sched if isinstance(result, TokenizedReq) else to_api).send(encode(result))
            elif isinstance(msg, AbortReq):
                to_sched.send(encode(msg))  # behind its request on the same socket
            elif isinstance(msg, TokenizerLimits):
                service.limits = msg

        serve_inbox(inbox, handle)


def detokenizer_main(launch: bytes) -> None:
    """Entry point of the detokenizer process: token ids in, text to the API server."""
    args = unpack_args(launch)
    addr = args["addresses"]
    with worker_process("detokenizer", addr["status"]) as (ctx, status):
        from ..models import ModelSource, load_tokenizer

        service = DetokenizerService(load_tokenizer(ModelSource.from_path(args["model"])))
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(addr["detokenizer"])
        to_api = ctx.socket(zmq.PUSH)
        to_api.connect(addr["api"])
        to_sched = ctx.socket(zmq.PUSH)
        to_sched.connect(addr["scheduler"])
        status.ready()
        status.start_heartbeat()

        def handle(msg: Any) -> None:
            if not isinstance(msg, StepOutput):
                return
            batch, stopped = service.process(msg)
            if batch.rids or batch.failed:
                to_api.send(encode(batch))
            for rid in stopped:
                to_sched.send(encode(StopReq(rid)))

        serve_inbox(inbox, handle)
