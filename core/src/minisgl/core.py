"""Core request types: sampling parameters, requests and batches."""

from __future__ import annotations

import enum
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
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be a positive integer, got {self.max_tokens}",
        )
        check(
            -2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}"
        )
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be an integer in [0, 20], got {self.logprobs}",
        )
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop_strings:
            check(isinstance(s, str) and s != "", "stop", "stop strings must be non-empty strings")
        for t, b in (self.logit_bias or {}).items():
            check(
                isinstance(t, int) and t >= 0,
                "logit_bias",
                f"keys must be token ids (non-negative integers), got {t!r}",
            )
            check(-100 <= b <= 100, "logit_bias", f"biases must be in [-100, 100], got {b!r} for token {t}")
        if self.grammar is not None:
            kind = self.grammar[0] if isinstance(self.grammar, tuple | list) and len(self.grammar) == 2 else None
            check(
                kind in GRAMMAR_KINDS,
                "grammar",
                f"must be (kind, text) with kind in {GRAMMAR_KINDS}, got {self.grammar!r}",
            )
        for t in self.stop_ids:
            check(
                isinstance(t, int) and t >= 0, "stop_token_ids", f"token ids must be non-negative integers, got {t!r}"
            )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(self.stop)

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
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "stop": list(self.stop_strings),
            "stop_token_ids": list(self.stop_ids),
            "ignore_eos": self.ignore_eos,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logprobs": self.logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            # Pairs, not a map: msgpack maps want string keys.
            "logit_bias": [[t, b] for t, b in self.logit_bias.items()] if self.logit_bias else None,
            "grammar": list(self.grammar) if self.grammar is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        d = dict(data)
        d["stop"] = tuple(d.get("stop") or ()) or None
        d["stop_token_ids"] = tuple(d.get("stop_token_ids") or ()) or None
        d["logit_bias"] = {int(t): float(b) for t, b in d.get("logit_bias") or ()} or None
        d["grammar"] = tuple(d["grammar"]) if d.get("grammar") else None
        return cls(**d)


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    error: str | None = None
    step_seed: int = 0  # sampling step count, mixed into a per-request seed
    matcher: Any = None  # the grammar matcher of a constrained request (xgrammar), None once finished

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains this request's next token."""
        return self.matcher is not None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def max_total_len(self) -> int:
        return len(self.input_ids) + self.max_new_tokens

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass(eq=False)
class Batch:
    """The requests of one forward step and the tensors the model needs.

    ``phase`` is "prefill" (any request extends by one or more tokens from its
    prompt) or "decode" (every request extends by exactly its last token).
    ``sample_mask[i]`` says whether request ``i`` reaches the end of its
    prompt in this step and so samples a token (a non-final prefill chunk does not).
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
