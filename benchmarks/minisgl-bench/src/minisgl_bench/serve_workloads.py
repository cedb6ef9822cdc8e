"""Workloads and arrival processes of ``minisgl bench serve``.

Every workload is a list of conversations; a conversation is one or more turns
sent one after another, each carrying the conversation so far. Prompts are
random token ids decoded to text with the model's tokenizer, so the generators
take a ``decode`` function and are exact given their seed:

``random`` (the benchmark protocol's online workload): ``rng = random.Random(0)``;
first every prompt, ``[rng.randint(1000, 20000) for _ in range(rng.randint(100, 1024))]``,
then every ``max_tokens = rng.randint(100, 1024)``; one user message per request.

``long-prompt``: the same generator with prompts of 2048-3072 ids and answers of 16-64 tokens.

``shared-prefix``: one system prompt of 2048 ids, drawn first; then for each user
and each of its turns in order: the question's length ``randint(16, 64)``, its ids,
and its ``max_tokens = randint(32, 128)``. All users share the system prompt; turn
k of a user carries the system prompt, that user's earlier questions and the
server's answers to them, and the new question.

With ``id_seed`` set, the workload is drawn as above and then every prompt's ids
are replaced by ids drawn from ``random.Random(id_seed)``: the same lengths with other
text (the warm-up, and later runs of a sweep, so that a prefix cache cannot serve them
from an earlier run).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

Decode = Callable[[list[int]], str]

TOKEN_ID_RANGE = (1000, 20000)


@dataclass(frozen=True)
class Turn:
    """One user message and the number of tokens to ask for."""

    text: str
    max_tokens: int
    drawn_tokens: int
    """Token ids drawn for ``text`` (the server's count differs a little after re-tokenizing)."""


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another; a turn waits for the answer to the one before."""

    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    """Conversations, an optional system prompt shared by all, and the parameters that made them."""

    name: str
    conversations: tuple[Conversation, ...]
    system: str | None = None
    system_tokens: int = 0
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        """Requests in all: every turn of every conversation."""
        return sum(len(c.turns) for c in self.conversations)

    @property
    def max_tokens_total(self) -> int:
        """Output tokens asked for over all requests."""
        return sum(t.max_tokens for c in self.conversations for t in c.turns)

    @property
    def drawn_input_tokens(self) -> int:
        """Token ids drawn for all requests, the system prompt counted once per request."""
        return sum(t.drawn_tokens + self.system_tokens for c in self.conversations for t in c.turns)

    def first_turns(self, n: int) -> Workload:
        """The first turn of each of the first ``n`` conversations (the warm-up's shape)."""
        convs = tuple(Conversation(c.turns[:1]) for c in self.conversations[:n])
        return replace(self, conversations=convs)


def _other_ids(prompts: list[list[int]], id_seed: int | None) -> list[list[int]]:
    """``prompts`` as drawn (``id_seed`` None), or prompts of the same lengths with ids from ``Random(id_seed)``."""
    if id_seed is None:
        return prompts
    rng = random.Random(id_seed)
    lo, hi = TOKEN_ID_RANGE
    return [[rng.randint(lo, hi) for _ in p] for p in prompts]


def single_turn_workload(
    decode: Decode,
    name: str,
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    id_seed: int | None = None,
) -> Workload:
    """``num_requests`` one-message requests: all prompts drawn first, then all output lengths."""
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    prompts = [[rng.randint(lo, hi) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    lens = [rng.randint(*output_len) for _ in range(num_requests)]
    prompts = _other_ids(prompts, id_seed)
    convs = tuple(Conversation((Turn(decode(p), n, len(p)),)) for p, n in zip(prompts, lens, strict=True))
    params = {"requests": num_requests, "input_len": list(input_len), "output_len": list(output_len)}
    return Workload(name, convs, params={**params, "token_ids": list(TOKEN_ID_RANGE), "seed": seed})


def shared_prefix_workload(
    decode: Decode,
    users: int,
    turns: int,
    system_len: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    id_seed: int | None = None,
) -> Workload:
    """``users`` conversations of ``turns`` turns under one shared system prompt."""
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    system_ids = [rng.randint(lo, hi) for _ in range(system_len)]
    questions, lens = [], []
    for _ in range(users * turns):
        questions.append([rng.randint(lo, hi) for _ in range(rng.randint(*input_len))])
        lens.append(rng.randint(*output_len))
    system_ids, *questions = _other_ids([system_ids, *questions], id_seed)
    convs = []
    for u in range(users):
        pairs = zip(questions[u * turns : (u + 1) * turns], lens[u * turns : (u + 1) * turns], strict=True)
        convs.append(Conversation(tuple(Turn(decode(q), n, len(q)) for q, n in pairs)))
    params = {
        "users": users,
        "turns": turns,
        "system_len": system_len,
        "input_len": list(input_len),
        "output_len": list(output_len),
        "token_ids": list(TOKEN_ID_RANGE),
        "seed": seed,
    }
    return Workload("shared-prefix", tuple(convs), decode(system_ids), system_len, params)


# name -> (input_len, output_len) defaults of the single-turn workloads and of the shared-prefix questions
DEFAULT_LENGTHS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "random": ((100, 1024), (100, 1024)),
    "long-prompt": ((2048, 3072), (16, 64)),
    "shared-prefix": ((16, 64), (32, 128)),
}


def build_workload(
    name: str,
    decode: Decode,
    num_requests: int,
    input_len: tuple[int, int] | None = None,
    output_len: tuple[int, int] | None = None,
    turns: int = 4,
    system_len: int = 2048,
    seed: int = 0,
    id_seed: int | None = None,
) -> Workload:
    """A workload by name; lengths default to ``DEFAULT_LENGTHS``. shared-prefix has ``num_requests // turns`` users."""
    if name not in DEFAULT_LENGTHS:
        raise ValueError(f"unknown workload '{name}'; known: {', '.join(DEFAULT_LENGTHS)}")
    d_in, d_out = DEFAULT_LENGTHS[name]
    inp, out = input_len or d_in, output_len or d_out
    if name == "shared-prefix":
        users = max(1, num_requests // turns)
        return shared_prefix_workload(decode, users, turns, system_len, inp, out, seed, id_seed)
    return single_turn_workload(decode, name, num_requests, inp, out, seed, id_seed)


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Start offsets (s) of ``n`` arrivals: all at 0 for an infinite rate, else a Poisson process.

    The gaps are exponential with mean ``1 / rate``, drawn from ``random.Random(seed)``;
    the first arrival is at 0.
    """
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive or inf, got {rate}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def load_decode(path: str) -> Decode:
    """``decode`` of a tokenizer: a directory with tokenizer files, a model directory, a .gguf file or ``dist:NAME``."""
    from transformers import AutoTokenizer

    from minisgl.models import ModelSource, load_tokenizer

    local = Path(path)
    if local.is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(local)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from '{path}': {exc}") from exc
    else:
        tokenizer = load_tokenizer(ModelSource.from_path(path))
        if tokenizer is None:
            raise ValueError(f"'{path}' has no tokenizer; pass --tokenizer DIR")
    return lambda ids: str(tokenizer.decode(ids))
