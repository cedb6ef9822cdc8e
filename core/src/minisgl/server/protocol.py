"""OpenAI request bodies, validated with pydantic (a bad value is a 400 naming its field); sampling parameters.

Types are strict, as OpenAI's are (``"4"`` is not an integer; an integer is accepted for a float), and every
string, at any depth, must be valid Unicode (JSON's ``\\ud800`` escape can smuggle in a lone surrogate no
tokenizer handles) and every value nested at most ``MAX_JSON_DEPTH`` deep: see :mod:`.validate`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core import SamplingParams, ValidationError
from .tools import forced_schema, template_tool_calls
from .validate import MAX_JSON_DEPTH, check_body, json_problem

_INT32 = 2**31 - 1  # bounds keep every value msgpack- and tensor-friendly
# OpenAI accepts at most 4 stop strings. Their length is bounded too: the detokenizer checks, for every new
# token, whether the output ends with the start of a stop string, which costs time quadratic in its length.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 128
MAX_N = 128  # the most choices per prompt any server accepts (OpenAI's limit); --max-n sets this server's own


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)


class _Request(_Body):
    """A whole request body: before any field is read, every value in it, at any depth, is checked for nesting
    and valid Unicode (:func:`check_body`), so a problem deep in a schema or a tool call is a 400 naming it."""

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        check_body(data)
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # refused when true


class ContentPart(_Body):
    """One part of a message's content; only text parts are taken (checked in ChatMessage.plain)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


# Fields of a chat message, refused (by ChatMessage.plain) unless absent.
MESSAGE_FIELDS = {
    "function_call": "the legacy function_call is not supported; send the call as tool_calls "
    '([{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}])',
    "refusal": "refusals are not taken as input; send the text as content",
    "audio": "audio is not supported (text only); leave audio out",
}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # of a tool message: passed to the chat template
    tool_calls: list[dict[str, Any]] | None = None  # of an assistant message: checked in plain()
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None

    def plain(self, where: str = "messages") -> dict[str, Any]:
        """The message as a chat template takes it (content as one string); ValidationError for what cannot be used."""
        for name, message in MESSAGE_FIELDS.items():
            if getattr(self, name) is not None:
                raise ValidationError(f"{where}.{name}", message)
        content = self.content
        if isinstance(content, list):
            for i, part in enumerate(content):
                if part.type != "text":
                    raise ValidationError(
                        f"{where}.content[{i}]",
                        f'content parts of type {part.type!r} are not supported (text only: {{"type": "text", '
                        '"text": ...})',
                    )
                extra = next(iter(part.model_extra or {}), None)
                if extra is not None:
                    raise ValidationError(
                        f"{where}.content[{i}].{extra}", "Unrecognized field of a text part (it takes only 'text')"
                    )
            content = "".join(p.text or "" for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.role == "tool" and self.tool_call_id is None:
            raise ValidationError(
                f"{where}.tool_call_id", "a tool message needs the tool_call_id of the assistant's call it answers"
            )
        if self.tool_call_id is not None:
            if self.role != "tool":
                raise ValidationError(f"{where}.tool_call_id", "only tool messages carry a tool_call_id")
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            if self.role != "assistant":
                raise ValidationError(f"{where}.tool_calls", "only assistant messages carry tool_calls")
            for i, call in enumerate(self.tool_calls):
                problem = _tool_call_problem(call)
                if problem is not None:
                    raise ValidationError(f"{where}.tool_calls[{i}]", problem)
            out["tool_calls"] = template_tool_calls(self.tool_calls)
        return out


def _tool_call_problem(call: dict[str, Any]) -> str | None:
    """What is wrong with an assistant message's tool call (OpenAI's shape), or None."""
    fn = call.get("function")
    if (
        call.get("type", "function") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), str)
        or not isinstance(call.get("id", ""), str)
        or set(call) - {"id", "type", "function"}
        or set(fn) - {"name", "arguments"}
    ):
        return 'a tool call is {"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'
    return _arguments_problem(fn["arguments"])


def _arguments_problem(arguments: str) -> str | None:
    """What is wrong with a tool call's ``arguments`` once decoded (the template gets the object), or None. Text
    that is not JSON is passed on as it is; decoded, it is held to the same nesting and Unicode bounds."""
    try:
        decoded = json.loads(arguments)
    except RecursionError:
        return f"function.arguments: nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays; flatten it"
    except ValueError:
        return None
    problem = json_problem(decoded, "function.arguments")
    return None if problem is None else f"{problem[0]} (decoded): {problem[1]}"


def _plain(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.plain(f"messages[{i}]") for i, m in enumerate(messages)]


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FUNCTION_NAME.match(v):
            raise ValueError(f"a function name is 1 to 64 letters, digits, '_' or '-', got {v!r}")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # The arguments are a JSON object, so their schema is one of an object (or {}: no arguments), as at OpenAI.
        if v is not None and v and v.get("type") != "object":
            got = f"type {v['type']!r}" if "type" in v else "no type"
            raise ValueError(f'the parameters are a JSON schema of "type": "object", got {got}')
        return v

    def for_template(self) -> dict[str, Any]:
        described = {} if self.description is None else {"description": self.description}
        parameters = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"name": self.name, **described, "parameters": parameters}


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


def _template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as chat templates take them (transformers' shape)."""
    return [{"type": "function", "function": t.function.for_template()} for t in tools]


# SamplingParams fields taken from the request as they are.
_PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
_DIRECT_PARAMS = ("temperature", "top_k", "top_p", "min_p", "ignore_eos", "skip_special_tokens", *_PENALTIES)


class _Sampling(_Request):
    """Fields shared by chat and completions."""

    _grammar_fields: ClassVar[tuple[str, ...]] = ("regex", "ebnf")

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
    # Accepted and validated; they change nothing in the output (at OpenAI they label the request for abuse
    # monitoring and cache routing; this server's prefix cache needs no key).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    # Token ids (as strings) to a bias in [-100, 100]; ids are checked against the vocabulary by check_vocab.
    logit_bias: dict[str, int | float] | None = None
    # Extensions (as SGLang's): constrain the output to a regular expression or an EBNF grammar.
    regex: str | None = Field(None, min_length=1)
    ebnf: str | None = Field(None, min_length=1)
    # Refused unless they ask for nothing: see UNSUPPORTED.
    service_tier: str | None = None
    store: bool | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:  # OpenAI's limits
            raise ValueError(f"at most 16 key-value pairs, got {len(v)}")
        if v is not None and (any(len(k) > 64 for k in v) or any(len(x) > 512 for x in v.values())):
            raise ValueError("keys may be at most 64 characters and values at most 512")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, int | float] | None) -> dict[str, int | float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit() or int(key) > _INT32:
                raise ValueError(f'keys are token ids written as strings of digits (e.g. "50256"), got {key!r}')
            if not -100 <= bias <= 100:
                raise ValueError(f"a bias is in [-100, 100], got {bias} for token {key}")
        return v

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

    def check_supported(self) -> None:
        """Raise ValidationError (a 400 naming the field) for the first thing this server cannot do."""
        fields = type(self).model_fields
        for table in (PENDING, UNSUPPORTED):
            for name, (is_noop, message) in table.items():
                if name in fields and not is_noop(getattr(self, name), self):
                    raise ValidationError(name, message)
        options = self.stream_options
        if options is not None and not self.stream:
            raise ValidationError("stream_options", "stream_options is only allowed with stream: true")
        if options is not None and options.include_obfuscation:
            raise ValidationError(
                "stream_options.include_obfuscation",
                "this server does not pad streamed chunks; leave include_obfuscation out or false",
            )
        if isinstance(self, ChatCompletionRequest):
            if self.top_logprobs is not None and not self.logprobs:
                raise ValidationError("top_logprobs", "top_logprobs needs logprobs: true")
            problem = self.tool_problem()
            if problem is not None:
                raise ValidationError(*problem)
        self.grammar()  # more than one constraint is refused
        if isinstance(self, CompletionRequest) and self.best_of is not None and self.best_of < self.n:
            raise ValidationError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")

    def check_vocab(self, vocab_size: int | None) -> None:
        """Refuse ``logit_bias`` ids outside the vocabulary."""
        bad = next((k for k in self.logit_bias or {} if int(k) >= vocab_size), None) if vocab_size else None
        if bad is not None:
            raise ValidationError("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")

    def _constraints(self) -> list[str]:
        """The fields sent that constrain the output (``{"type": "text"}`` asks for nothing)."""
        return [f for f in self._grammar_fields if getattr(self, f) not in (None, {"type": "text"})]

    def grammar(self) -> tuple[tuple[str, str] | None, str | None]:
        """The output constraint (kind, text) and the request field that asked for it, or (None, None)."""
        sources = self._constraints()
        if len(sources) > 1:
            names = self._grammar_fields
            allowed = f"{', '.join(names[:-1])} and {names[-1]}"
            raise ValidationError(sources[1], f"send at most one of {allowed} (got {' and '.join(sources)})")
        return ((sources[0], getattr(self, sources[0])), sources[0]) if sources else (None, None)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int) -> SamplingParams:
        """Parameters of choice ``index``: with ``n`` > 1 and a seed, each choice gets its own seed."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        bias = {int(k): float(b) for k, b in (self.logit_bias or {}).items() if b != 0}
        return SamplingParams(
            **{name: getattr(self, name) for name in _DIRECT_PARAMS},
            seed=None if self.seed is None else self.seed + index,
            max_tokens=max_tokens,
            stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
            logprobs=logprobs,
            logit_bias=bias or None,
            grammar=self.grammar()[0],
        )


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    _grammar_fields: ClassVar[tuple[str, ...]] = ("response_format", "regex", "ebnf")

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked in tool_problem
    parallel_tool_calls: bool | None = None
    # Refused unless they ask for nothing: see UNSUPPORTED.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = None if v is None else v.get("type")
        if v is None or (kind in ("text", "json_object") and set(v) == {"type"}):
            return v
        if kind == "json_schema" and set(v) == {"type", "json_schema"} and isinstance(v["json_schema"], dict):
            spec = v["json_schema"]
            extra = set(spec) - {"name", "description", "schema", "strict"}
            if extra:
                raise ValueError(f"json_schema takes name, description, schema and strict, not {sorted(extra)[0]!r}")
            if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), bool | None):
                raise ValueError("json_schema.name is a string and json_schema.strict a boolean")
            if "schema" in spec and not isinstance(spec["schema"], dict):
                raise ValueError("json_schema.schema is a JSON schema (an object)")
            return v
        raise ValueError(
            'expected {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
        )

    def plain_messages(self) -> list[dict[str, Any]]:
        return _plain(self.messages)

    def tool_mode(self) -> tuple[str, str | None]:
        """("off" | "auto" | "required" | "named", the named function). ``off``: no tools, or ``tool_choice:
        "none"`` (the template is not shown the tools and the output is not parsed, as at OpenAI)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return "off", None
        if isinstance(choice, dict):
            return "named", choice["function"]["name"]
        return ("required", None) if choice == "required" else ("auto", None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tool_mode()[0] == "off" else _template_tools(self.tools or [])

    def tool_problem(self) -> tuple[str, str] | None:
        """(field, message) for tool fields that do not fit together, or None."""
        names = [t.function.name for t in self.tools or []]
        dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if dup is not None:
            return "tools", f"two tools are named {dup!r}; names must be unique"
        choice = self.tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function")
            if (
                choice.get("type") != "function"
                or set(choice) != {"type", "function"}
                or not isinstance(fn, dict)
                or set(fn) != {"name"}
                or not isinstance(fn["name"], str)
            ):
                return "tool_choice", 'a named tool choice is {"type": "function", "function": {"name": ...}}'
            if fn["name"] not in names:
                offered = ", ".join(repr(n) for n in names) or "none"
                return "tool_choice", f"the function {fn['name']!r} is not among the tools (offered: {offered})"
        elif choice is not None and choice not in ("none", "auto", "required"):
            return "tool_choice", f'expected "none", "auto", "required" or a named function, got {choice!r}'
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None and not names:
                return name, f"{name} is only allowed when tools are given; send tools or leave {name} out"
        other = next(iter(self._constraints()), None)
        if other is not None and self.tool_mode()[0] in ("required", "named"):
            asked = "required" if choice == "required" else "naming a function"
            return other, f"{other} cannot be combined with tool_choice {asked} (the call's schema shapes the output)"
        return None

    def grammar(self) -> tuple[tuple[str, str] | None, str | None]:
        grammar, field = super().grammar()
        mode, name = self.tool_mode()
        if mode in ("required", "named"):
            functions = [t.function.for_template() for t in self.tools or []]
            schema = forced_schema(functions, name, self.parallel_tool_calls is not False)
            return ("json_schema", json.dumps(schema)), "tool_choice"
        if field == "response_format":  # json_object, or json_schema with or without a schema
            given = ((self.response_format or {}).get("json_schema") or {}).get("schema")
            grammar = ("json", "") if given is None else ("json_schema", json.dumps(given))
        return grammar, field

    def params(self, index: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, index)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, strings, a token-id list or token-id lists."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=_INT32)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

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


# ------------------------------------------------------------------ what is refused
# A field's entry: (does this value, seen with the whole request, ask for nothing?, what to tell the client).
Check = Callable[[Any, Any], bool]


def _one_of(*values: Any) -> Check:
    return lambda v, body: v is None or any(type(v) is type(x) and v == x for x in values)


# Features another change will implement: delete the entry when one lands and honour the field (its type is
# already declared on the request model). Empty: every OpenAI field is honoured or, in UNSUPPORTED, refused for good.
PENDING: dict[str, tuple[Check, str]] = {}

# What this server does not do, and no change plans to.
UNSUPPORTED: dict[str, tuple[Check, str]] = {
    # OpenAI's deprecated form of tools; its replies differ (message.function_call), so it is refused, not half-mapped.
    "functions": (
        lambda v, body: v is None or v == [],
        'the legacy functions are not supported; send them as tools ([{"type": "function", '
        '"function": {...}}]) with tool_choice',
    ),
    "function_call": (
        lambda v, body: v is None or (v in ("none", "auto") and not body.functions),
        "the legacy function_call is not supported; send tool_choice (with tools) instead",
    ),
    "echo": (_one_of(False), "echoing the prompt is not supported; leave echo out or false"),
    "suffix": (_one_of(""), "suffixes (insertion) are not supported; leave suffix out"),
    "best_of": (
        lambda v, body: v is None or v <= body.n,  # below n is refused by check_supported, with its own message
        "generating best_of candidates and returning the n best is not supported; leave best_of out or set it "
        "equal to n",
    ),
    "audio": (_one_of(), "audio output is not supported (text only); leave audio out"),
    "modalities": (_one_of(["text"]), 'only text output is supported; leave modalities out or send ["text"]'),
    "prediction": (_one_of(), "predicted outputs are not supported; leave prediction out"),
    "reasoning_effort": (_one_of(), "reasoning_effort is not supported; leave it out"),
    "verbosity": (_one_of(), "verbosity is not supported; leave it out"),
    "web_search_options": (_one_of(), "web search is not supported; leave web_search_options out"),
    "store": (_one_of(False), "this server stores no completions; leave store out or false"),
    "service_tier": (
        _one_of("auto", "default"),
        'this server has one service tier; leave service_tier out or send "auto" or "default"',
    ),
    "prompt_cache_retention": (
        _one_of("in-memory"),
        'the prefix cache lives in memory only; leave prompt_cache_retention out or send "in-memory"',
    ),
}


# ------------------------------------------------------------------ /tokenize, /detokenize (vLLM's shapes)
class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` (through the chat template, with ``tools``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # Default: true for a prompt (as /v1/completions tokenizes it), false for messages (the chat template
    # writes any BOS token itself, as /v1/chat/completions does).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # messages only

    def template_tools(self) -> list[dict[str, Any]] | None:
        if self.tools and self.messages is None:
            raise ValidationError("tools", "tools apply to messages only")
        return _template_tools(self.tools) if self.tools else None

    def source(self) -> str | list[dict[str, Any]]:
        """The prompt, or the messages as the chat template takes them; refuses what does not fit together."""
        if (self.prompt is None) == (self.messages is None):
            raise ValidationError("prompt", "send either prompt (a string) or messages (a chat), not both or neither")
        if self.messages is not None:
            return _plain(self.messages)
        if self.add_generation_prompt is not None:
            raise ValidationError("add_generation_prompt", "add_generation_prompt applies to messages only")
        return self.prompt or ""


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        bad = next((i for i, t in enumerate(v) if not 0 <= t <= _INT32), None)
        if bad is not None:
            raise ValueError(f"token id {v[bad]} (item {bad}) is not a valid token id")
        return v
