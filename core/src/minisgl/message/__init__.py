"""Messages between the server's processes, encoded with msgpack (never pickle).

Every message is a small dataclass of plain values. :func:`encode` writes a
message as a msgpack extension carrying the class tag and the field values in
declaration order; :func:`decode` rebuilds it. The per-step messages
(:class:`StepOutput`, :class:`OutputBatch`) are columnar: one list per field
rather than one object per token, so a step of 256 tokens is one msgpack call
with no per-token Python callbacks.

Flow (rid = request id, an int chosen by the API server)::

    API --GenerateReq/AbortReq--> tokenizer i --TokenizedReq/AbortReq--> scheduler
    API <--RequestFailed-- tokenizer i         (refused before reaching the scheduler)
    scheduler --StepOutput--> detokenizer --OutputBatch--> API
    detokenizer --StopReq--> scheduler         (a stop string ended the request)
    every worker --WorkerStatus/Heartbeat--> launcher (in the API process)

An abort travels through the tokenizer worker that took the request, behind it
on the same sockets, so the scheduler never sees an abort before its request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

_EXT_MESSAGE = 1


@dataclass
class GenerateReq:
    """A new request from the API server. Exactly one of ``text``, ``messages``, ``input_ids`` is set.

    ``params`` is :meth:`SamplingParams.to_dict`, validated by the API server. ``tools`` (with
    ``messages`` only) are the request's function tools, for the chat template.
    """

    rid: int
    params: dict[str, Any]
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class TokenizedReq:
    """A request as the scheduler receives it: token ids and sampling parameters (``SamplingParams.to_dict``)."""

    rid: int
    input_ids: list[int]
    params: dict[str, Any]


@dataclass
class TokenizerLimits:
    """What a tokenizer worker checks before a request reaches the scheduler (sent once, first)."""

    max_model_len: int
    vocab_size: int


@dataclass
class AbortReq:
    """Stop request ``rid`` now and free its KV pages (the client went away)."""

    rid: int


@dataclass
class StopReq:
    """Request ``rid`` hit a stop string (found by the detokenizer): finish it and free its pages."""

    rid: int


@dataclass
class RequestFailed:
    """Request ``rid`` was refused. ``field`` names the offending parameter."""

    rid: int
    field: str
    message: str


@dataclass
class StepOutput:
    """What one scheduler loop iteration tells the detokenizer.

    ``rids[i]`` sampled ``tokens[i]``. ``finished`` lists ``[i, finish_reason,
    stop_token, cached_tokens]`` for the events that ended their request
    (``stop_token``: it ended on an EOS or stop token id, whose text is not
    output). ``logprobs`` is None when no event carries any, else one
    ``[logprob, [[token_id, logprob], ...]]`` or None per event. ``accepted``
    lists ``[rid, prompt_tokens, stop_strings, skip_special_tokens,
    wants_logprobs]`` for requests queued in this iteration (always before their
    first event); ``failed`` lists ``[rid, field, message]``; ``dropped`` lists
    requests ended without an event (aborted), whose state can go.
    """

    rids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: list[list[Any]] = field(default_factory=list)
    logprobs: list[Any] | None = None
    accepted: list[list[Any]] = field(default_factory=list)
    failed: list[list[Any]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


@dataclass
class OutputBatch:
    """New output of several requests (detokenizer -> API server), columnar.

    ``texts[i]`` is the new text of request ``rids[i]`` (possibly empty while a
    multi-byte character or a possible stop string is held back) and
    ``counts[i]`` its completion tokens so far. ``finished`` lists ``[i,
    finish_reason, prompt_tokens, cached_tokens]``. ``logprobs`` is None when no
    output carries any, else per output None or a list of ``[token_text,
    logprob, [[alt_text, alt_logprob], ...]]``. ``failed`` lists ``[rid, field,
    message]`` of requests the scheduler refused.
    """

    rids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    finished: list[list[Any]] = field(default_factory=list)
    logprobs: list[Any] | None = None
    failed: list[list[Any]] = field(default_factory=list)


@dataclass
class WorkerStatus:
    """A worker's start-up or fatal state, sent to the launcher.

    ``state`` is "ready" (``info`` describes the loaded model), or "error"
    (``error`` is the message to show the user; ``detail`` the traceback).
    """

    worker: str
    state: str
    error: str = ""
    detail: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Heartbeat:
    """A worker is alive (sent every half second by a thread of its own).

    ``busy_for`` is how long the worker has been inside its current unit of work
    (an engine step), 0 between them; ``state`` holds worker-specific gauges (the
    scheduler's running and waiting requests and KV pages).
    """

    worker: str
    busy_for: float = 0.0
    state: dict[str, Any] = field(default_factory=dict)


MESSAGE_TYPES: tuple[type, ...] = (
    GenerateReq,
    TokenizedReq,
    TokenizerLimits,
    AbortReq,
    StopReq,
    RequestFailed,
    StepOutput,
    OutputBatch,
    WorkerStatus,
    Heartbeat,
)
_TAGS: dict[type, int] = {cls: i for i, cls in enumerate(MESSAGE_TYPES)}
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in MESSAGE_TYPES}


def _default(obj: Any) -> Any:
    tag = _TAGS.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__} as a message")
    values = [getattr(obj, name) for name in _FIELDS[type(obj)]]
    return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb([tag, *values], default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        return msgpack.ExtType(code, data)
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    return MESSAGE_TYPES[tag](*values)


def encode(message: Any) -> bytes:
    """msgpack bytes of a message (a dataclass from this module)."""
    return msgpack.packb(message, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """The message encoded in ``data``."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def recv_all(sock: Any) -> list[Any]:
    """Every message already queued on ZMQ socket ``sock``, decoded, without blocking."""
    import zmq

    out = []
    while True:
        try:
            out.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


__all__ = [cls.__name__ for cls in MESSAGE_TYPES] + ["MESSAGE_TYPES", "decode", "encode", "recv_all"]
