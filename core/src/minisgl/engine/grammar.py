"""Structured output: grammars compiled by xgrammar (an optional extra, imported on first use), one matcher
per request, and each step's allowed-token bitmask of the constrained rows, filled on the host and copied to
the device as a :class:`TokenMask` that the sampler applies to the logits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core import ValidationError

INSTALL_HINT = "structured output needs the xgrammar package: pip install 'minisgl[structured]'"


def _xgrammar(field: str) -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ValidationError(field, INSTALL_HINT) from exc
    return xgrammar


def error_field(kind: str) -> str:
    """The API parameter a bad grammar of ``kind`` is reported against."""
    return "response_format" if kind in ("json", "json_schema") else "grammar"


@dataclass
class TokenMask:
    """The allowed tokens of the constrained rows of one sampling batch, on the device."""

    bitmask: torch.Tensor  # [n, ceil(vocab / 32)] int32, bit j of word w: token 32 * w + j allowed
    rows: list[int]  # the rows of the batch it applies to (the others are free)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens of ``rows`` to -inf, in place."""
        import xgrammar

        vocab = min(logits.shape[1], self.bitmask.shape[1] * 32)
        xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=vocab, indices=self.rows)


class GrammarBackend:
    """Compiles grammars for one tokenizer (into a bounded LRU cache) and fills one scheduler's bitmasks.

    ``vocab_size`` is the model's (its logits may be wider than the tokenizer's vocabulary);
    ``stop_token_ids`` end a request and are allowed only where the grammar may end.
    """

    cache_size = 64  # compiled grammars kept

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *, max_rows: int, device: torch.device
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_rows = max_rows
        self.device = device
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiler: Any = None  # built on the first grammar request (the tokenizer scan takes a moment)
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None

    def _get_compiler(self, field: str) -> Any:
        if self._compiler is None:
            xgr = _xgrammar(field)
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
            # Our own LRU below is the cache (bounded by entries); xgrammar's is off.
            self._compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
        return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of ``(kind, text)``; :class:`ValidationError` if it is invalid."""
        field = error_field(kind)
        key = (kind, "" if kind == "json" else text)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiler = self._get_compiler(field)
        what = {"json": "json", "json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}
        if kind not in what:
            raise ValidationError("grammar", f"unknown grammar kind {kind!r}")
        try:
            if kind == "json":
                # Any JSON object, compact: free whitespace lets a small model pad forever.
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError/its own errors
            raise ValidationError(field, f"invalid {what[kind]}: {str(exc).strip() or type(exc).__name__}") from exc
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per request) of a compiled grammar."""
        import xgrammar

        # With no stop token known, the matcher ends as soon as the grammar is complete.
        return xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_token_ids)

    def fill(self, matchers: Sequence[tuple[int, Any]], n: int) -> TokenMask | None:
        """The device bitmask of a batch of ``n`` rows, ``matchers`` being the constrained ``(row, matcher)``.
        The host buffer is reused: the caller waits for the last step that used it (the scheduler reads a
        constrained step's tokens before it fills the next mask)."""
        if not matchers:
            return None
        if self._host is None or self._dev is None:
            import xgrammar

            host = xgrammar.allocate_token_bitmask(self.max_rows, self.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
            self._dev = self._host if self.device.type == "cpu" else torch.empty_like(host, device=self.device)
        host, dev = self._host, self._dev
        for row, m in matchers:
            m.fill_next_token_bitmask(host, row)
        if dev is not host:
            dev[:n].copy_(host[:n], non_blocking=True)
        return TokenMask(dev[:n], [row for row, _ in matchers])
