"""OpenAI request bodies, validated with pydantic; conversion to sampling parameters.

Range checks live here so that a bad value is a 400 naming its field before
anything reaches a worker. Types are strict, as OpenAI's are: ``"4"`` is not an
integer and ``"yes"`` is not a boolean (an integer is accepted for a float).
Every string must be valid Unicode: JSON's ``\\ud800`` escape can smuggle in a
lone surrogate, which no tokenizer or encoder downstream can handle. Unknown
fields are ignored, as OpenAI-compatible servers usually do, so clients that
send extra options keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core import SamplingParams

_INT32 = 2**31 - 1  # bounds keep every value msgpack- and tensor-friendly
# OpenAI accepts at most 4 stop strings. Their length is bounded too: the detokenizer checks, for
# every new token, whether the output ends with the start of a stop string, which costs time
# quadratic in a stop string's length.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 128
# The most choices per prompt any server accepts (OpenAI's limit); --max-n sets this server's own.
MAX_N = 128


def surrogate_problem(value: Any) -> str | None:
    """Why ``value`` (a string, a list of strings or of content parts, a model) is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = f"U+{ord(value[exc.start]):04X}"
            return (
                f"the string holds an unpaired surrogate ({char}) at character {exc.start}; text must be valid "
                "Unicode (a character outside the Basic Multilingual Plane is sent as a surrogate pair or as UTF-8)"
            )
        return None
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            problem = surrogate_problem(getattr(value, name))
            if problem is not None:
                return f"{name}: {problem}"
        return None
    # Lists are homogeneous here (strings, token ids or content parts): lists of ids need no walk.
    if isinstance(value, list) and value and isinstance(value[0], (str, BaseModel)):
        for i, item in enumerate(value):
            problem = surrogate_problem(item)
            if problem is not None:
                return f"item {i}: {problem}"
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class _Checked(_Body):
    """A body whose every string must be valid Unicode.

    Models nested in a union (content parts) are checked by the field holding them: an error
    raised inside would be reported as the union's first alternative (a string) not matching.
    """

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, v: Any) -> Any:
        problem = surrogate_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Checked):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def plain(self) -> dict[str, Any]:
        """The message as a chat template expects it: content as one string."""
        content = self.content
        if isinstance(content, list):
            unsupported = [p.type for p in content if p.type != "text"]
            if unsupported:
                from ..core import ValidationError

                raise ValidationError(
                    "messages", f"content parts of type {unsupported[0]!r} are not supported (text only)"
                )
            content = "".join(p.text or "" for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class _Sampling(_Checked):
    """Fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=_INT32)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=_INT32)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        long = next((s for s in items if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters, got one of {len(long)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= t <= _INT32 for t in v):
            raise ValueError("token ids must be non-negative (and below 2**31)")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int) -> SamplingParams:
        """Parameters of choice ``index``: with ``n`` > 1 and a seed, each choice gets its own seed."""
        seed = None if self.seed is None else self.seed + index
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=seed,
            max_tokens=max_tokens,
            stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
            ignore_eos=self.ignore_eos,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def params(self, index: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, index)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, strings, a token-id list or token-id lists."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=_INT32)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in v):
            raise ValueError("a token-id prompt is empty")
        ids = [t for p in v for t in (p if isinstance(p, list) else [p])] if isinstance(v, list) else []
        bad = next((t for t in ids if isinstance(t, int) and not 0 <= t <= _INT32), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not a valid token id")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def params(self, index: int) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, index)
