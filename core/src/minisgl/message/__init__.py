"""Messages between the server's processes: small dataclasses of plain values, encoded with msgpack (never
pickle) as an extension holding the class tag and the field values in order. Per-step messages are
columnar (one list per field), so a step of many tokens is one msgpack call with no per-token callbacks.

Flow (rid: an int chosen by the API server)::

    API --GenerateReq/AbortReq--> tokenizer i --TokenizedReq/AbortReq--> scheduler
    API <--RequestFailed-- tokenizer i         (refused before reaching the scheduler)
    scheduler --StepOutput--> detokenizer --OutputBatch--> API
    detokenizer --StopReq--> scheduler         (a stop string ended the request)
    every worker --WorkerStatus/Heartbeat--> launcher (in the API process)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

_EXT_MESSAGE = 1


@dataclass
class GenerateReq:
    """A new request: exactly one of ``text``, ``messages``, ``input_ids``; ``params`` is
    :meth:`SamplingParams.to_dict`; ``tools`` (with ``messages``) go to the chat template."""

    rid: int
    params: dict[str, Any]
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class TokenizedReq:
    """A request as the scheduler receives it: token ids and ``SamplingParams.to_dict``."""

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
    """Request ``rid`` was refused; ``field`` names the offending parameter."""

    rid: int
    field: str
    message: str


@dataclass
class StepOutput:
    """One scheduler iteration, for the detokenizer: ``rids[i]`` sampled ``tokens[i]`` (-1: it ended without a
    token, its grammar's mask having been late).

    ``finished``: ``[i, finish_reason, stop_token, cached_tokens]`` per event that ended its request
    (``stop_token``: an EOS or stop token id, whose text is not output). ``logprobs``: None when no event
    has any, else per event None or ``[logprob, [[token_id, logprob], ...]]``. ``accepted``: ``[rid,
    prompt_tokens, stop_strings, skip_special_tokens, wants_logprobs]`` per request queued now (before its
    first event). ``failed``: ``[rid, field, message]``. ``dropped``: requests ended without an event.
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
    """New output (detokenizer -> API server): ``texts[i]`` of request ``rids[i]`` (empty while a partial
    character or possible stop string is held back), ``counts[i]`` its completion tokens so far.

    ``finished``: ``[i, finish_reason, prompt_tokens, cached_tokens]``. ``logprobs``: None when no output
    has any, else per output None or ``[[token_text, logprob, [[alt_text, alt_logprob], ...]], ...]``.
    ``failed``: ``[rid, field, message]`` of requests the scheduler refused.
    """

    rids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    finished: list[list[Any]] = field(default_factory=list)
    logprobs: list[Any] | None = None
    failed: list[list[Any]] = field(default_factory=list)


@dataclass
class WorkerStatus:
    """A worker's state for the launcher: "ready" (``info`` describes the model) or "error" (``error`` for
    the user, ``detail`` the traceback)."""

    worker: str
    state: str
    error: str = ""
    detail: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Heartbeat:
    """A worker is alive (every half second, from its own thread). ``busy_for``: seconds inside the current
    unit of work (an engine step), 0 between; ``state``: worker gauges (running/waiting requests, pages)."""

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
    return msgpack.packb(message, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
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
