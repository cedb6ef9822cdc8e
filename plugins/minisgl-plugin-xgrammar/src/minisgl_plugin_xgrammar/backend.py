"""The ``xgrammar`` grammar backend: grammars compiled by xgrammar into a bounded LRU cache, one matcher per
request, and each step's bitmask of the constrained rows filled on the host and copied to the device."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar

from minisgl.core import ValidationError
from minisgl.engine.grammar import BaseGrammarBackend, TokenMask, error_field

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
        compiler = self._get_compiler()
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
            why = str(exc).strip() or type(exc).__name__
            raise ValidationError(field, f"invalid {KIND_NAMES[kind]}: {why}") from exc
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

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
