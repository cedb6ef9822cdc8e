"""The tokenizer/detokenizer worker process.

Requests from the API server are turned into token ids here (chat template
for chat messages) and sent on to the scheduler; token events coming back
from the scheduler are turned into text (with stop strings applied) and sent
to the API server. Keeping this out of the API server keeps its event loop
free for HTTP, and out of the scheduler keeps tokenization off the GPU loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from ..message import (
    AbortReq,
    Accepted,
    GenerateReq,
    OutputBatch,
    RequestFailed,
    Stats,
    StatsReq,
    StepOutput,
    TokenEventMsg,
    TokenizedReq,
    TokenOutput,
    encode,
    recv_all,
)
from .detokenize import IncrementalDetokenizer


@dataclass
class _Live:
    """What the detokenizer keeps for one request."""

    detok: IncrementalDetokenizer | None
    logprobs: bool
    completion_tokens: int = 0


class TokenizerService:
    """Tokenizes requests and detokenizes outputs; no sockets, so it is testable on its own."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.live: dict[int, _Live] = {}

    def tokenize(self, req: GenerateReq) -> TokenizedReq | RequestFailed:
        tok = self.tokenizer
        try:
            if req.input_ids is not None:
                ids = [int(t) for t in req.input_ids]
            elif tok is None:
                field = "messages" if req.messages is not None else "prompt"
                return RequestFailed(req.rid, field, "this model has no tokenizer; send token ids as the prompt")
            elif req.messages is not None:
                text = tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
                # The template already wrote any BOS token the model wants.
                ids = list(tok.encode(text, add_special_tokens=False))
            else:
                ids = list(tok.encode(req.text or ""))
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            field = "messages" if req.messages is not None else "prompt"
            return RequestFailed(req.rid, field, f"cannot tokenize the request: {exc}")
        params = req.params
        detok = None
        if tok is not None:
            detok = IncrementalDetokenizer(
                tok, skip_special_tokens=params.get("skip_special_tokens", True), stop=params.get("stop") or ()
            )
        self.live[req.rid] = _Live(detok, params.get("logprobs") is not None)
        return TokenizedReq(req.rid, ids, params)

    def forget(self, rid: int) -> None:
        self.live.pop(rid, None)

    def detokenize(self, step: StepOutput) -> OutputBatch:
        outputs = []
        for ev in step.events:
            live = self.live.get(ev.rid)
            if live is None:  # aborted meanwhile
                continue
            live.completion_tokens += 1
            outputs.append(self._output(ev, live))
            if ev.finished:
                del self.live[ev.rid]
        return OutputBatch(outputs)

    def _output(self, ev: TokenEventMsg, live: _Live) -> TokenOutput:
        text = ""
        if live.detok is not None:
            if ev.finished and ev.stop_token:
                text = live.detok.finish()  # the stop token's own text is not output
            else:
                text = live.detok.push(ev.token, final=ev.finished)
        logprobs = None
        if live.logprobs and ev.logprob is not None:
            top = [[self._token_text(int(t)), float(lp)] for t, lp in (ev.top or [])]
            logprobs = [[self._token_text(ev.token), float(ev.logprob), top]]
        return TokenOutput(
            rid=ev.rid,
            text=text,
            token_ids=[ev.token],
            finished=ev.finished,
            finish_reason=ev.finish_reason,
            completion_tokens=live.completion_tokens,
            cached_tokens=ev.cached_tokens,
            logprobs=logprobs,
        )

    def _token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"<{token}>"
        return self.tokenizer.decode([token], skip_special_tokens=False)


def tokenizer_main(launch: bytes) -> None:
    """Entry point of the tokenizer process (see :mod:`minisgl.server.launcher`)."""
    from ..server.process import ParentWatch, unpack_args, worker_process

    args = unpack_args(launch)
    addr = args["addresses"]
    with worker_process("tokenizer", addr["status"]) as (ctx, status):
        from ..models import ModelSource, load_tokenizer

        service = TokenizerService(load_tokenizer(ModelSource.from_path(args["model"])))
        from_api = ctx.socket(zmq.PULL)
        from_api.bind(addr["tokenizer"])
        from_sched = ctx.socket(zmq.PULL)
        from_sched.bind(addr["detokenizer"])
        to_sched = ctx.socket(zmq.PUSH)
        to_sched.connect(addr["scheduler"])
        to_api = ctx.socket(zmq.PUSH)
        to_api.connect(addr["api"])
        poller = zmq.Poller()
        poller.register(from_api, zmq.POLLIN)
        poller.register(from_sched, zmq.POLLIN)
        status.ready(has_tokenizer=service.tokenizer is not None)
        watch = ParentWatch()
        while not (watch.due() and watch.parent_gone()):
            ready = dict(poller.poll(200))
            if from_api in ready:
                _drain_api(from_api, service, to_sched, to_api)
            if from_sched in ready:
                _drain_scheduler(from_sched, service, to_api)


def _drain_api(sock: zmq.Socket, service: TokenizerService, to_sched: zmq.Socket, to_api: zmq.Socket) -> None:
    for msg in recv_all(sock):
        if isinstance(msg, GenerateReq):
            result = service.tokenize(msg)
            (to_sched if isinstance(result, TokenizedReq) else to_api).send(encode(result))
        elif isinstance(msg, AbortReq):
            service.forget(msg.rid)
            to_sched.send(encode(msg))
        elif isinstance(msg, StatsReq):
            to_sched.send(encode(msg))


def _drain_scheduler(sock: zmq.Socket, service: TokenizerService, to_api: zmq.Socket) -> None:
    for msg in recv_all(sock):
        if isinstance(msg, StepOutput):
            batch = service.detokenize(msg)
            if batch.outputs:
                to_api.send(encode(batch))
        elif isinstance(msg, RequestFailed):
            service.forget(msg.rid)
            to_api.send(encode(msg))
        elif isinstance(msg, (Accepted, Stats)):
            to_api.send(encode(msg))
