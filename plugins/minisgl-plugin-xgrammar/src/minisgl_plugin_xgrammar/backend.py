"""The ``xgrammar`` grammar backend: grammars compiled by xgrammar into a bounded LRU cache, one matcher per
request, and each step's bitmask of the constrained rows filled on the host (in parallel, each row within the mask
budget) and copied to the device.

With compile limits set (the scheduler sets them from ``--grammar-compile-timeout`` and
``--grammar-compile-memory``), a grammar is compiled in a child process that is killed past either limit
(:mod:`.compile_process`); without, in this process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
import xgrammar

from minisgl.core import ValidationError
from minisgl.engine.grammar import BaseGrammarBackend, TokenMask, error_field

from .compile_process import CompileLimitError, CompileProcess, CompileRefused
from .grammars import COMPACT, KIND_NAMES, compile_grammar
from .schema import schema_problem

__all__ = ["COMPACT", "KIND_NAMES", "XGrammarBackend", "XGrammarMask"]


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
    enforces_compile_limits = True  # the compile process is killed at the limits

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
        self._cache_lock = threading.Lock()  # compile runs on the scheduler's grammar thread, cached() on its own
        self._info: Any = None  # built on the first compile (the tokenizer scan takes a moment)
        self._compiler: Any = None
        self._process: CompileProcess | None = None
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None  # fills masks in parallel
        self._last_fill: dict[int, float] = {}  # id(matcher) -> seconds its last mask took
        self._threads = max(1, min(8, (os.cpu_count() or 2) // 2))

    def _tokenizer_info(self) -> Any:
        if self._info is None:
            self._info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
        return self._info

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            # Our own LRU below is the cache (bounded by entries); xgrammar's is off.
            self._compiler = xgrammar.GrammarCompiler(
                self._tokenizer_info(), max_threads=self._threads, cache_enabled=False
            )
        return self._compiler

    @staticmethod
    def _key(kind: str, text: str) -> tuple[str, str]:
        return (kind, "" if kind == "json" else text)

    def cached(self, kind: str, text: str) -> Any:
        with self._cache_lock:
            hit = self._cache.get(self._key(kind, text))
            if hit is not None:
                self._cache.move_to_end(self._key(kind, text))
            return hit

    def compile(self, kind: str, text: str) -> Any:
        field = error_field(kind)
        hit = self.cached(kind, text)
        if hit is not None:
            return hit
        if kind not in KIND_NAMES:
            raise ValidationError("grammar", f"unknown grammar kind {kind!r}")
        if kind == "json_schema":
            self._check_schema(text)
        try:
            compiled = self._compile_bounded(kind, text)
        except CompileLimitError as exc:
            raise ValidationError(field, self._limit_message(kind, str(exc))) from None
        except CompileRefused as exc:
            raise ValidationError(field, f"invalid {KIND_NAMES[kind]}: {exc}") from None
        if self._admits_nothing(compiled):
            raise ValidationError(field, f"no string satisfies this {KIND_NAMES[kind]}: it allows no first token")
        with self._cache_lock:
            self._cache[self._key(kind, text)] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_bounded(self, kind: str, text: str) -> Any:
        """Compiled in the child process when a limit is set, else here; CompileRefused for a bad grammar."""
        limits = self.limits
        if limits.compile_seconds is None and limits.compile_memory_bytes is None:
            try:
                return compile_grammar(self._get_compiler(), kind, text)
            except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError/its own errors
                raise CompileRefused(str(exc).strip() or type(exc).__name__) from exc
        if self._process is None:
            self._process = CompileProcess(self._tokenizer_info().serialize_json(), self._threads)
        seconds = limits.compile_seconds if limits.compile_seconds is not None else float("inf")
        serialized = self._process.compile(kind, text, seconds, limits.compile_memory_bytes)
        return xgrammar.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info())

    def _limit_message(self, kind: str, which: str) -> str:
        limits = self.limits
        if which == "memory":
            assert limits.compile_memory_bytes is not None
            spent = f"needed more than {limits.compile_memory_bytes / 2**20:.0f} MiB"
            flag = "--grammar-compile-memory"
        else:
            spent = f"took longer than {limits.compile_seconds:g} s"
            flag = "--grammar-compile-timeout"
        return (
            f"compiling this {KIND_NAMES[kind]} {spent} (the server's limit, {flag}); make it smaller: fewer "
            "or smaller bounded repetitions ({m,n}, maxLength, maxItems), less nesting, fewer alternatives"
        )

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
        constrained step's tokens before it fills the next mask). A row given up on (``late``) may still be
        written by its fill, so the buffer is replaced then.

        With a mask budget, a matcher whose last mask took over a quarter of it is filled on a thread and given
        up on once it runs past the budget; the others are filled as usual (in this thread, or spread over the
        threads for a large batch) and timed, and one that took longer than the budget is late too (its request
        ends; this keeps one slow grammar from slowing every later step)."""
        if not matchers:
            return None
        if self._host is None or self._dev is None:
            host = xgrammar.allocate_token_bitmask(self.max_rows, self.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
            self._dev = self._host if self.device.type == "cpu" else torch.empty_like(host, device=self.device)
        host, dev = self._host, self._dev
        budget = self.limits.mask_seconds
        slow = budget * self.slow_share if budget is not None else None
        watched = {row for row, m in matchers if slow is not None and self._last_fill.get(id(m), 0.0) > slow}
        seconds: dict[int, float] = {}
        left: set[int] = set()
        if watched and budget is not None:
            pending, started = self._start_watched(host, [(row, m) for row, m in matchers if row in watched])
            self._fill_quick(host, [(row, m) for row, m in matchers if row not in watched], seconds)
            left = self._wait_watched(pending, started, budget, seconds)
        else:
            self._fill_quick(host, list(matchers), seconds)
        late = left | ({row for row, t in seconds.items() if t > budget} if budget is not None else set())
        self._last_fill = {id(m): seconds[row] for row, m in matchers if row in seconds and row not in late}
        if left:
            self._host = None  # a fill given up on may still write its row: the next step takes a fresh buffer
            if dev is host:
                self._dev = None
        if dev is not host:
            dev[:n].copy_(host[:n], non_blocking=True)
        return XGrammarMask(dev[:n], [row for row, _ in matchers if row not in late], late=sorted(late))

    slow_share = 0.25  # of the mask budget: a matcher slower than this last time is filled where it can be left
    parallel_rows = 16  # a step with at least this many quick rows spreads them over the threads

    def _fill_quick(self, host: torch.Tensor, matchers: list[tuple[int, Any]], seconds: dict[int, float]) -> None:
        """Fill and time each row: here, one after another, or in groups on the threads for a large batch
        (xgrammar releases the GIL while it fills)."""

        def run(group: list[tuple[int, Any]]) -> None:
            for row, m in group:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(host, row)
                seconds[row] = time.perf_counter() - t0

        if len(matchers) < self.parallel_rows:
            run(matchers)
            return
        groups = min(self._threads, len(matchers) // 4)
        for f in [self._get_pool().submit(run, matchers[g::groups]) for g in range(groups)]:
            f.result()

    def _start_watched(
        self, host: torch.Tensor, matchers: list[tuple[int, Any]]
    ) -> tuple[dict[Future[None], int], dict[int, float]]:
        """Start each row on a thread of its own: the futures (to their rows) and when each row's fill started."""
        started: dict[int, float] = {}

        def job(row: int, m: Any) -> None:
            started[row] = time.monotonic()
            m.fill_next_token_bitmask(host, row)

        pool = self._get_pool()
        return {pool.submit(job, row, m): row for row, m in matchers}, started

    @staticmethod
    def _wait_watched(
        pending: dict[Future[None], int], started: dict[int, float], budget: float, seconds: dict[int, float]
    ) -> set[int]:
        """Wait for the watched rows; those whose own fill has run longer than ``budget`` are given up on."""
        late: set[int] = set()
        while pending:
            now = time.monotonic()
            for f, row in list(pending.items()):
                if f.done():
                    f.result()
                    seconds[row] = now - started.get(row, now)
                    del pending[f]
                elif row in started and now - started[row] > budget:
                    late.add(row)
                    del pending[f]
            if pending:
                running = [started[row] for row in pending.values() if row in started]
                timeout = max(min(running, default=now) + budget - now, 0.0) + 0.001
                wait(list(pending), timeout=timeout)
        return late

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="grammar-mask")
        return self._pool

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
