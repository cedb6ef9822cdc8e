"""The ``xgrammar`` grammar backend: grammars compiled by xgrammar into a bounded LRU cache, one matcher per
request, and each step's bitmask of the constrained rows filled on the host and copied to the device."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar

from minisgl.core import ValidationError
from minisgl.engine.grammar import BaseGrammarBackend, TokenMask, error_field

from .schema import schema_problem

# Replies are compact JSON: no whitespace, not even xgrammar's default ", " and ": " separators.
COMPACT = {"any_whitespace": False, "separators": (",", ":")}
KIND_NAMES = {"json": "json", "json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}


class XGrammarMask(TokenMask):
    """A :class:`TokenMask` applied by xgrammar's kernel (C++ on CPU, Triton or CUDA on a GPU)."""

    def apply(self, logits: torch.Tensor) -> None:
        vocab = min(logits.shape[1], self.bitmask.shape[1] * 32)
        xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=vocab, indices=self.rows)


class XGrammarBackend(BaseGrammarBackend):
    """Compiles grammars for one tokenizer and fills one scheduler's bitmasks (of at most ``max_rows`` rows).

    ``vocab_size`` is the model's (its logits may be wider than the tokenizer's vocabulary);
    ``stop_token_ids`` end a request and are allowed only where the grammar may end.
    """

    cache_size = 64  # compiled grammars kept

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        device: torch.device,
        *,
        stop_token_ids: Sequence[int],
        max_rows: int,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self.stop_token_ids = list(stop_token_ids)
        self.max_rows = max_rows
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiler: Any = None  # built on the first grammar request (the tokenizer scan takes a moment)
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
            # Our own LRU below is the cache (bounded by entries); xgrammar's is off.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=8, cache_enabled=False)
        return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        field = error_field(kind)
        key = (kind, "" if kind == "json" else text)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        if kind not in KIND_NAMES:
            raise ValidationError("grammar", f"unknown grammar kind {kind!r}")
        if kind == "json_schema":
            self._check_schema(text)
        compiler = self._get_compiler()
        try:
            if kind == "json":
                # Any JSON object, compact: free whitespace lets a small model pad forever.
                compiled = compiler.compile_json_schema('{"type": "object"}', **COMPACT)
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(text, strict_mode=True, **COMPACT)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError/its own errors
            why = str(exc).strip() or type(exc).__name__
            raise ValidationError(field, f"invalid {KIND_NAMES[kind]}: {why}") from exc
        if self._admits_nothing(compiled):
            raise ValidationError(field, f"no string satisfies this {KIND_NAMES[kind]}: it allows no first token")
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _admits_nothing(self, compiled: Any) -> bool:
        """Whether a fresh matcher of ``compiled`` allows no token at all (stop tokens included)."""
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_token_ids)
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        logits = torch.zeros(1, self.vocab_size)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return not bool(torch.isfinite(logits).any())

    @staticmethod
    def _check_schema(text: str) -> None:
        """Refuse a schema that uses what xgrammar does not enforce (before xgrammar sees it)."""
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValidationError(error_field("json_schema"), f"invalid JSON schema: {exc}") from None
        problem = schema_problem(schema)
        if problem is not None:
            raise ValidationError(error_field("json_schema"), problem)

    def matcher(self, compiled: Any) -> Any:
        # With no stop token known, the matcher ends as soon as the grammar is complete.
        return xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_token_ids)

    def fill(self, matchers: Sequence[tuple[int, Any]], n: int) -> TokenMask | None:
        """The host buffer is reused: the caller waits for the last step that used it (the scheduler reads a
        constrained step's tokens before it fills the next mask)."""
        if not matchers:
            return None
        if self._host is None or self._dev is None:
            host = xgrammar.allocate_token_bitmask(self.max_rows, self.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
            self._dev = self._host if self.device.type == "cpu" else torch.empty_like(host, device=self.device)
        host, dev = self._host, self._dev
        for row, m in matchers:
            m.fill_next_token_bitmask(host, row)
        if dev is not host:
            dev[:n].copy_(host[:n], non_blocking=True)
        return XGrammarMask(dev[:n], [row for row, _ in matchers])
