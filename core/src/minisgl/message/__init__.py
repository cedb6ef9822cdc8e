"""Messages between the server's processes, encoded with msgpack (never pickle).

Every message is a small dataclass of plain values. :func:`encode` writes a
message as a msgpack extension carrying the class tag and the field values in
declaration order; :func:`decode` rebuilds it. Nested messages (a batch of
token events) use the same extension, so the format needs no schema beyond
the classes below.

Flow (rid = request id, an int chosen by the API server)::

    API server --GenerateReq/AbortReq/StatsReq--> tokenizer --TokenizedReq/AbortReq/StatsReq--> scheduler
    API server <--Accepted/RequestFailed/OutputBatch/Stats-- detokenizer <--Accepted/.../StepOutput/Stats-- scheduler
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

_EXT_MESSAGE = 1


@dataclass
class GenerateReq:
    """A new request from the API server. Exactly one of ``text``, ``messages``, ``input_ids`` is set."""

    rid: int
    params: dict[str, Any]
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None


@dataclass
class TokenizedReq:
    """A request as the scheduler receives it: token ids and sampling parameters (``SamplingParams.to_dict``)."""

    rid: int
    input_ids: list[int]
    params: dict[str, Any]


@dataclass
class AbortReq:
    """Stop request ``rid`` now and free its KV pages (the client went away)."""

    rid: int


@dataclass
class StatsReq:
    """Ask the scheduler for :class:`Stats`; ``token`` pairs the answer with the question."""

    token: int


@dataclass
class Accepted:
    """The scheduler queued request ``rid``; its prompt has ``prompt_tokens`` tokens."""

    rid: int
    prompt_tokens: int


@dataclass
class RequestFailed:
    """Request ``rid`` was refused. ``field`` names the offending parameter."""

    rid: int
    field: str
    message: str


@dataclass
class TokenEventMsg:
    """One new token of one request (scheduler -> detokenizer).

    ``stop_token`` says the request ended on an EOS or stop token id, whose
    text is not part of the output. ``top`` holds ``[token_id, logprob]`` pairs.
    """

    rid: int
    token: int
    finished: bool
    finish_reason: str | None = None
    stop_token: bool = False
    cached_tokens: int = 0
    logprob: float | None = None
    top: list[list[Any]] | None = None


@dataclass
class StepOutput:
    """Every token event of one scheduler step."""

    events: list[TokenEventMsg] = field(default_factory=list)


@dataclass
class TokenOutput:
    """New output of one request (detokenizer -> API server).

    ``text`` is the new text (possibly empty while a multi-byte character or a
    possible stop string is held back). ``logprobs`` holds, per new token,
    ``[token_text, logprob, [[alt_text, alt_logprob], ...]]``.
    """

    rid: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    completion_tokens: int
    cached_tokens: int
    logprobs: list[list[Any]] | None = None


@dataclass
class OutputBatch:
    """Every :class:`TokenOutput` made from one scheduler step."""

    outputs: list[TokenOutput] = field(default_factory=list)


@dataclass
class Stats:
    """Scheduler state for /health and /metrics."""

    token: int
    running: int
    waiting: int
    kv_pages_used: int  # owned by live requests
    kv_pages_cached: int  # owned by the prefix cache
    kv_pages_total: int
    page_size: int
    max_model_len: int


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


MESSAGE_TYPES: tuple[type, ...] = (
    GenerateReq,
    TokenizedReq,
    AbortReq,
    StatsReq,
    Accepted,
    RequestFailed,
    TokenEventMsg,
    StepOutput,
    TokenOutput,
    OutputBatch,
    Stats,
    WorkerStatus,
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
