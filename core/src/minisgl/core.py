"""Core request types: sampling parameters, requests and batches."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class ValidationError(ValueError):
    """Bad user input. ``field`` names the offending parameter (for API errors)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


GRAMMAR_KINDS = ("json", "json_schema", "regex", "ebnf")


def prompt_problem(ids: Sequence[int], max_tokens: int | None, max_len: int, vocab: int) -> tuple[str, str] | None:
    """``(field, message)`` saying why a prompt can never run in a context of ``max_len`` tokens, or None."""
    if not ids:
        return "prompt", "the prompt is empty"
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        return "prompt", f"token id {bad} is outside the vocabulary [0, {vocab})"
    n = len(ids)
    if n >= max_len:
        return "prompt", f"the prompt has {n} tokens, but the context length is {max_len} (leave room for output)"
    if max_tokens is not None and n + max_tokens > max_len:
        return "max_tokens", (
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the context length {max_len}"
        )
    return None


def _is_int(v: object, low: int, high: float = float("inf")) -> bool:
    return isinstance(v, int) and low <= v <= high


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``logprobs``
    asks for the log-probability of each chosen token plus the ``logprobs``
    most likely alternatives (0 = chosen token only, ``None`` = none).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    #: Added to the logits of these token ids before sampling (OpenAI's ``logit_bias``: -100 bans, 100 forces).
    logit_bias: dict[int, float] | None = None
    #: Constrained decoding: ``(kind, text)`` with kind ``json`` (any JSON object; text ignored),
    #: ``json_schema`` (text: a JSON schema), ``regex`` or ``ebnf`` (text: the pattern or grammar).
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValidationError(name, message)

        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(_is_int(self.top_k, -1), "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        mt = self.max_tokens
        check(mt is None or _is_int(mt, 1), "max_tokens", f"must be a positive integer, got {mt}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        lp = self.logprobs
        check(lp is None or _is_int(lp, 0, 20), "logprobs", f"must be an integer in [0, 20], got {lp}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop_strings:
            check(isinstance(s, str) and s != "", "stop", "stop strings must be non-empty strings")
        for t, b in (self.logit_bias or {}).items():
            check(_is_int(t, 0), "logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
            check(-100 <= b <= 100, "logit_bias", f"biases must be in [-100, 100], got {b!r} for token {t}")
        if self.grammar is not None:
            g = self.grammar
            kind = g[0] if isinstance(g, tuple | list) and len(g) == 2 else None
            check(kind in GRAMMAR_KINDS, "grammar", f"must be (kind, text) with kind in {GRAMMAR_KINDS}, got {g!r}")
        for t in self.stop_ids:
            check(_is_int(t, 0), "stop_token_ids", f"token ids must be non-negative integers, got {t!r}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.stop_token_ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a message: lists, and ``logit_bias`` as pairs (msgpack maps want string keys)."""
        d = dict(self.__dict__)
        d["stop"] = list(self.stop_strings)
        d["stop_token_ids"] = list(self.stop_ids)
        d["logit_bias"] = [[t, b] for t, b in self.logit_bias.items()] if self.logit_bias else None
        d["grammar"] = list(self.grammar) if self.grammar is not None else None
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        d = dict(data)
        d["stop"] = tuple(d.get("stop") or ()) or None
        d["stop_token_ids"] = tuple(d.get("stop_token_ids") or ()) or None
        d["logit_bias"] = {int(t): float(b) for t, b in d.get("logit_bias") or ()} or None
        d["grammar"] = tuple(d["grammar"]) if d.get("grammar") else None
        return cls(**d)


class ReqStatus(enum.Enum):
    COMPILING = "compiling"  # its grammar is being compiled; queued once that is done
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


LOGPROB_FLOOR = -9999.0  # the logprob reported for a token that has none (-inf, NaN), as OpenAI reports it


@dataclass
class TokenLogprob:
    """Log-probability of a chosen token and the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler and engine see it.

    Token positions ``[0, cached_len)`` have their KV in the cache (``cached_len``
    grows as prefill chunks and decode steps complete); ``[cached_len, device_len)``
    are computed by the batch the request is in now.
    """

    rid: int
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: str | None = None
    table_idx: int = -1
    cached_len: int = 0
    device_len: int = 0
    prefix_len: int = 0  # prompt tokens taken from the prefix cache at admission
    cache_handle: Any = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    step_seed: int = 0  # sampling step count, mixed into a per-request seed
    matcher: Any = None  # the grammar matcher of a constrained request (from the grammar backend), None once finished
    #: Leading tokens of ``all_ids`` computed as a prefill: the prompt, or after a preemption the prompt and the
    #: tokens generated so far (recomputed; the last one's logits sample the next token). 0: the prompt.
    fill_len: int = 0
    preemptions: int = 0  # times the scheduler retracted this request to free its pages

    def __post_init__(self) -> None:
        if self.fill_len == 0:
            self.fill_len = len(self.input_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def is_decoding(self) -> bool:
        """Whether every token the host knows has its KV (or is computed in flight): the next step decodes."""
        return self.cached_len >= self.fill_len

    def fill_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of the prefill, ``end <= fill_len``."""
        return self.input_ids[start:end] if end <= len(self.input_ids) else self.all_ids[start:end]

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def max_total_len(self) -> int:
        return len(self.input_ids) + self.max_new_tokens

    @property
    def tokens_left(self) -> int:
        """Output tokens it may still generate (``max_new_tokens`` less those the host has)."""
        return self.max_new_tokens - len(self.output_ids)

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass(eq=False)
class Batch:
    """The requests of one forward step and the tensors the model needs.

    ``phase`` is "prefill" (requests extend by one or more prompt tokens) or "decode" (each by
    its last token). ``sample_mask[i]``: request ``i`` reaches the end of its prompt in this step
    and so samples a token (a non-final prefill chunk does not).
    """

    reqs: list[Req]
    phase: str
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_loc: torch.Tensor | None = None
    sample_mask: list[bool] = field(default_factory=list)
    padded_size: int = 0  # decode batch size after CUDA-graph padding
    attn_metadata: Any = None

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"
