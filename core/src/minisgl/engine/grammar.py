"""Structured output: the interface of a grammar backend (a plugin component kind), the one a scheduler holds
and fills each step's :class:`TokenMask` of the constrained rows with; the sampler applies it to the logits.

The scheduler compiles grammars on a thread of its own (one compile at a time), so a slow grammar delays only its
own request; :class:`GrammarLimits` bound what one request's grammar may cost.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)


def error_field(kind: str) -> str:
    """The API parameter a bad grammar of ``kind`` is reported against."""
    return "response_format" if kind in ("json", "json_schema") else "grammar"


@dataclass
class TokenMask:
    """The allowed tokens of the constrained rows of one sampling batch, on the device."""

    bitmask: torch.Tensor  # [n, ceil(vocab / 32)] int32, bit j of word w: token 32 * w + j allowed
    rows: list[int]  # the rows of the batch it applies to (the others are free)
    # Constrained rows whose mask was not ready within GrammarLimits.mask_seconds: their requests end with
    # finish reason grammar_error, and what is sampled for them is discarded.
    late: list[int] = field(default_factory=list)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens of ``rows`` to -inf, in place (a backend may bring a faster kernel)."""
        vocab, rows = min(logits.shape[1], self.bitmask.shape[1] * 32), torch.tensor(self.rows, device=logits.device)
        bits = torch.arange(32, dtype=self.bitmask.dtype, device=logits.device)
        allowed = ((self.bitmask[rows].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()
        logits[rows, :vocab] = logits[rows, :vocab].masked_fill(~allowed, float("-inf"))


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (None: unbounded). The scheduler sets a backend's ``limits``."""

    compile_seconds: float | None = None  # one compile's time
    compile_memory_bytes: int | None = None  # the memory one compile may add
    mask_seconds: float | None = None  # one request's mask in one step


class BaseGrammarBackend(ABC):
    """Compiles grammars for one tokenizer and fills one scheduler's masks (docs/plugin-contracts.md).

    Threads: ``compile`` runs on the scheduler's grammar thread, one call at a time, while ``cached``, ``matcher``
    and ``fill`` run on the scheduler's own thread."""

    limits: GrammarLimits = GrammarLimits()
    # Whether compile itself stops at limits.compile_seconds (else the scheduler gives up on it a second later).
    enforces_compile_limits: bool = False

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of ``(kind, text)``; ``ValidationError(error_field(kind), ...)`` if invalid or
        past ``limits`` (unless ``enforces_compile_limits``, the scheduler gives up on a compile a second past
        ``compile_seconds`` and refuses its request; the call itself runs on)."""

    def cached(self, kind: str, text: str) -> Any:
        """The compiled grammar of ``(kind, text)`` if it is at hand without compiling (the request is queued at
        once), else None."""
        return None

    def close(self) -> None:
        """Release what the backend started (threads, processes); it is not used afterwards."""
        return None

    @abstractmethod
    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per request), with ``accept_token(token) -> bool`` and ``is_terminated() -> bool``."""

    @abstractmethod
    def fill(self, matchers: Sequence[tuple[int, Any]], n: int) -> TokenMask | None:
        """The mask of a batch of ``n`` rows, ``matchers`` the constrained ``(row, matcher)`` (None if none); a
        row whose matcher takes longer than ``limits.mask_seconds`` may be given up on and listed in ``late``
        (its matcher is not used again)."""


def make_grammar_backend(
    engine: Engine, tokenizer: Any, stop_token_ids: Sequence[int]
) -> tuple[BaseGrammarBackend | None, str]:
    """The grammar backend of a scheduler on ``engine`` (``--grammar-backend``; ``auto``: the best installed), or
    None and why grammars are refused (under ``auto``, also when no installed backend runs here). A backend named
    but not installed, or not usable here, raises UnknownComponentError."""
    cfg, registry, device = engine.config, engine.registry, engine.device.type
    if cfg.grammar_backend == "auto" and not registry.names("grammar"):
        return None, "structured output needs a grammar backend plugin (the project ships minisgl-plugin-xgrammar)"
    if cfg.grammar_backend == "auto" and not registry.supported("grammar", device):
        # Installed but unusable here (its library is missing, say): serve without structured output.
        specs = registry.specs("grammar")
        why = "; ".join(f"{s.label}: {s.unsupported_reason(device) or 'unsupported'}" for s in specs)
        logger.warning("structured output is off: no installed grammar backend runs on %s (%s)", device, why)
        return None, f"structured output is off on this server: no installed grammar backend runs on {device} ({why})"
    spec = registry.pick("grammar", cfg.grammar_backend, device)
    if tokenizer is None:
        return None, "structured output needs a tokenizer; this engine has none"
    vocab, rows = int(engine.hf_config.vocab_size), cfg.max_running_requests
    backend = spec.build(tokenizer, vocab, engine.device, stop_token_ids=stop_token_ids, max_rows=rows)
    backend.limits = GrammarLimits(
        compile_seconds=cfg.grammar_compile_timeout or None,
        compile_memory_bytes=int(cfg.grammar_compile_memory * 2**20) or None,
        mask_seconds=cfg.grammar_mask_timeout or None,
    )
    return backend, ""
