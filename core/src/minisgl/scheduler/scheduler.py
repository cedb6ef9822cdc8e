"""Continuous batching: chunked prefill mixed into decode steps, admission on what a request needs now, preemption,
overlap.

A step decodes every running request and, while prompt tokens wait, computes up to ``chunked_prefill_size`` of them
in the same batch (``mixed_prefill``; off: a step is a prefill while prompt tokens wait, else a decode). Admission is
first come, first served; a request reserves pages for its prefill plus ``admit_reserve_tokens`` of output (at most
its ``max_tokens``) and grows past that from the spare pages. When a step's decodes find no spare page, the newest
running request is preempted: its pages go back (its computed prefix to the prefix cache), it keeps its output and
returns to the front of the queue, and on re-admission its prompt and output are computed again as one prefill (the
last token's logits sample the next one), so greedy and seeded outputs are those of an unpreempted run.

``schedule_policy="throughput"`` (batch jobs) admits the longest ``max_tokens`` first and paces prompt tokens into
the decode steps: a step computes enough of them to fill it to ``throughput_step_tokens`` (where the GEMMs turn
from reading weights to computing, so those prompt tokens cost little), and more only when a waiting request would
otherwise start too late to end with the longest running one. The prompts' compute then hides under the weight
reads of the decode steps instead of running in steps of its own.

A request with a grammar whose compiled form is not cached waits in ``COMPILING`` while a thread of the
scheduler's compiles it (one at a time), and joins the queue when that is done: a slow grammar delays only its
own request. Whoever drives the scheduler learns which of them were queued or refused from
:meth:`Scheduler.take_grammar_outcomes`. A constrained request whose mask is late (the backend's
``mask_seconds``) ends with ``grammar_error`` instead of slowing the batch.

With ``overlap_schedule`` batch N+1 is launched before N's tokens are read (decode feeds the token the engine
kept on the device), so a request that stops in N may compute one discarded token in N+1. Requests whose
sampling reads host-side history (penalties, logprobs) switch to lock-step while they run. A step that preempts
reads the batch in flight first.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..core import Batch, Req, ReqStatus, SamplingParams, TokenLogprob, ValidationError, prompt_problem
from ..engine import Engine, PendingStep, StepInputs
from ..engine.grammar import TokenMask, error_field, make_grammar_backend
from ..kvcache import KVCacheManager
from .trace import StepClock, StepTrace

logger = logging.getLogger(__name__)

# Steps of slack the throughput policy leaves before a waiting request's latest start (overlap, rounding).
_PACE_MARGIN_STEPS = 16


@dataclass
class TokenEvent:
    """One request's progress in one step: a new token, and whether it finished."""

    req: Req
    token: int | None  # None: the request ended without a token (its grammar mask was late)
    logprob: TokenLogprob | None
    finished: bool


@dataclass
class _Compile:
    """A grammar being compiled for ``req`` on the grammar thread."""

    req: Req
    future: Future[Any]
    times: list[float] = field(default_factory=list)  # [started, ended] as the thread saw them (monotonic)


class Scheduler:
    """Drives an :class:`Engine`; ``tokenizer`` is needed for structured output only (else grammars are refused)."""

    def __init__(
        self,
        engine: Engine,
        *,
        eos_token_ids: Sequence[int] = (),
        detokenize: Callable[[Sequence[int]], str] | None = None,
        tokenizer: Any = None,
    ):
        self.engine = engine
        self.config = cfg = engine.config
        cache = engine.prefix_cache_spec.build(page_size=cfg.page_size, device=engine.device)
        rows, cols = engine.page_table.shape
        self.kv = KVCacheManager(engine.kv_pool.layout.num_pages, cfg.page_size, rows, cols, cache)
        self.eos_token_ids = tuple(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[Req] = deque()
        self._longest_first = cfg.schedule_policy == "throughput"
        self._waiting_unsorted = False  # throughput policy: requests joined the queue since it was last ordered
        self.running: list[Req] = []
        self._by_rid: dict[int, Req] = {}
        self._rids = itertools.count()
        self.vocab_size = int(engine.hf_config.vocab_size)
        self.stats = {
            "prompt_tokens": 0,
            "computed_prompt_tokens": 0,  # recomputed ones included
            "cached_prompt_tokens": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "recomputed_tokens": 0,  # tokens a preemption dropped from the KV cache (some come back from the cache)
        }
        self.overlap = cfg.overlap_schedule
        self._inflight: tuple[Batch, PendingStep] | None = None
        self._lockstep_reqs = 0  # live requests whose sampling reads host-side history
        self.grammar, self._no_grammar = make_grammar_backend(engine, tokenizer, self.eos_token_ids)
        self._compiles: dict[int, _Compile] = {}
        self._compile_thread: ThreadPoolExecutor | None = None
        self._grammar_outcomes: list[tuple[Req, ValidationError | None]] = []
        self._late: set[int] = set()  # requests whose mask in the batch in flight was late
        self.replays = False  # a tensor-parallel follower: rank 0 says when a compiled request is queued
        self._clock: StepClock | None = None  # the step being traced
        self.trace: StepTrace | None = None
        if cfg.trace_steps and engine.tp.rank == 0:
            header = {
                "model": str(cfg.model),
                "device": str(engine.device),
                "page_size": cfg.page_size,
                "num_pages": int(self.kv.usable_pages),
                "chunked_prefill_size": cfg.chunked_prefill_size,
                "max_running_requests": cfg.max_running_requests,
                "mixed_prefill": cfg.mixed_prefill,
                "schedule_policy": cfg.schedule_policy,
                "throughput_step_tokens": cfg.throughput_step_tokens,
                "admit_reserve_tokens": cfg.admit_reserve_tokens,
                "overlap_schedule": cfg.overlap_schedule,
                "cuda_graphs": engine.graphs is not None,
                "prefill_graph_max_tokens": engine.prefill_graph_max_tokens,
            }
            try:
                self.trace = StepTrace(cfg.trace_steps, header, engine.device)
            except OSError as exc:
                why = f"cannot open '{cfg.trace_steps}' for appending ({exc.strerror}); give a writable file"
                raise ValidationError("trace_steps", why) from None

    def add_request(self, input_ids: Sequence[int], params: SamplingParams, rid: int | None = None) -> Req:
        """Validate and queue a request; :class:`ValidationError` if it can never run."""
        ids = [int(t) for t in input_ids]
        max_len = self.engine.max_model_len
        problem = prompt_problem(ids, params.max_tokens, max_len, self.vocab_size)
        if problem is not None:
            raise ValidationError(*problem)
        req = Req(
            rid=next(self._rids) if rid is None else rid,
            input_ids=ids,
            params=params,
            max_new_tokens=params.max_tokens if params.max_tokens is not None else max_len - len(ids),
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
        )
        if not self.kv.fits_ever(req):
            need = self.kv.pages_for(req.max_total_len)
            raise ValidationError(
                "max_tokens",
                f"the request needs {req.max_total_len} tokens of KV cache ({need} pages) but the pool has only "
                f"{self.kv.usable_pages} pages of {self.kv.page_size}; lower max_tokens or enlarge the KV cache",
            )
        if req.rid in self._by_rid:
            raise ValidationError("rid", f"request id {req.rid} is already in use")
        bad = next((t for t in params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise ValidationError("logit_bias", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if _needs_lockstep(req):
            self._lockstep_reqs += 1
        self._by_rid[req.rid] = req
        if params.grammar is not None:
            kind, text = params.grammar
            if self.grammar is None:
                del self._by_rid[req.rid]
                self._lockstep_reqs -= int(_needs_lockstep(req))
                raise ValidationError(error_field(kind), self._no_grammar)
            compiled = self.grammar.cached(kind, text)
            if compiled is None or self.replays:  # a follower queues it when rank 0 says so
                req.status = ReqStatus.COMPILING
                if compiled is None:
                    self._compiles[req.rid] = self._submit_compile(req, kind, text)
                else:
                    done: Future[Any] = Future()
                    done.set_result(compiled)
                    self._compiles[req.rid] = _Compile(req, done)
                return req
            req.matcher = self.grammar.matcher(compiled)
        self._enqueue(req)
        return req

    def _enqueue(self, req: Req, *, front: bool = False) -> None:
        """Put ``req`` in the waiting queue (``front``: before the others, as a preempted request)."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        self._waiting_unsorted = self._longest_first

    def _submit_compile(self, req: Req, kind: str, text: str) -> _Compile:
        assert self.grammar is not None
        backend = self.grammar
        if self._compile_thread is None:
            self._compile_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        times: list[float] = []

        def run() -> Any:
            times.append(time.monotonic())
            try:
                return backend.compile(kind, text)
            finally:
                times.append(time.monotonic())

        return _Compile(req, self._compile_thread.submit(run), times)

    def take_grammar_outcomes(self) -> list[tuple[Req, ValidationError | None]]:
        """Requests that left ``COMPILING`` since the last call: ``(req, None)`` queued, ``(req, error)`` refused
        (it is gone; ``error`` says why, against the request field that sent the grammar)."""
        out, self._grammar_outcomes = self._grammar_outcomes, []
        return out

    def _collect_compiles(self, wait: float = 0.0) -> None:
        """Queue the requests whose grammar compiled, refuse those that failed or ran past the time limit;
        with ``wait``, first wait up to that long for one to finish."""
        if not self._compiles:
            return
        if wait > 0:
            concurrent.futures.wait(
                [c.future for c in self._compiles.values()], timeout=wait, return_when="FIRST_COMPLETED"
            )
        assert self.grammar is not None
        limit = None if self.grammar.enforces_compile_limits else self.grammar.limits.compile_seconds
        now = time.monotonic()
        for rid, c in list(self._compiles.items()):
            req = c.req
            kind = req.params.grammar[0] if req.params.grammar is not None else "grammar"
            if c.future.done():
                del self._compiles[rid]
                try:
                    compiled = c.future.result()
                except ValidationError as exc:
                    self._refuse(req, exc)
                    continue
                except Exception as exc:  # a backend's own failure: this request's, not the server's
                    logger.exception("request %s: compiling its grammar failed", rid)
                    self._refuse(req, ValidationError(error_field(kind), f"compiling the grammar failed: {exc}"))
                    continue
                if self.trace is not None and len(c.times) == 2:
                    self.trace.note(f"grammar_compile:{(c.times[1] - c.times[0]) * 1000:.1f}ms")
                self._queue_compiled(req, compiled)
                self._grammar_outcomes.append((req, None))
                self._grammar_queued(req)
            elif limit is not None and c.times and now - c.times[0] > limit + 1.0:
                # The backend did not stop at its limit: give up on it (the thread finishes on its own).
                del self._compiles[rid]
                why = f"compiling the grammar took longer than {limit:g} s (--grammar-compile-timeout); make it smaller"
                self._refuse(req, ValidationError(error_field(kind), why))

    def _refuse(self, req: Req, exc: ValidationError) -> None:
        self._by_rid.pop(req.rid, None)
        if _needs_lockstep(req):
            self._lockstep_reqs -= 1
        req.status = ReqStatus.FINISHED
        req.finish_reason = "refused"
        self._grammar_outcomes.append((req, exc))
        self._grammar_refused(req)

    def _grammar_queued(self, req: Req) -> None:
        """Hook: ``req``'s grammar compiled and it joined the queue (rank 0 tells the other ranks)."""

    def _grammar_refused(self, req: Req) -> None:
        """Hook: ``req`` was refused after its grammar failed to compile (rank 0 tells the other ranks)."""

    def queue_compiled(self, rid: int) -> None:
        """A follower: queue request ``rid`` now, as rank 0 did, once its own compile is done (waiting for it)."""
        c = self._compiles.pop(rid, None)
        if c is None:
            return
        try:
            compiled = c.future.result()
        except Exception as exc:  # rank 0 compiled the same grammar: this rank cannot follow it
            raise RuntimeError(f"this rank could not compile a grammar rank 0 compiled (request {rid}): {exc}") from exc
        self._queue_compiled(c.req, compiled)

    def _queue_compiled(self, req: Req, compiled: Any) -> None:
        """``req`` leaves ``COMPILING`` for the queue, with a matcher of its compiled grammar."""
        assert self.grammar is not None
        req.matcher = self.grammar.matcher(compiled)
        req.status = ReqStatus.WAITING
        self._enqueue(req)

    def abort(self, rid: int, reason: str = "abort") -> Req | None:
        """Finish request ``rid`` now (with ``reason``), returning its pages. None if unknown or done."""
        req = self._by_rid.get(rid)
        if req is None or req.is_finished:
            return None
        self._finish(req, reason)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None or self._compiles)

    @property
    def num_compiling(self) -> int:
        return len(self._compiles)

    def live_requests(self) -> list[Req]:
        """Every request not finished: compiling, waiting or running."""
        return list(self._by_rid.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> list[TokenEvent]:
        """Run one batch (see the module docstring for what it holds). The events of the batch whose tokens
        arrived (with overlap, the previous one). With only grammars compiling, waits a little for one."""
        if not self.replays:
            self._collect_compiles_before_step()
        return self._step()

    def _collect_compiles_before_step(self) -> None:
        """Collect the finished compiles; with nothing else to run, wait a little for one (no busy loop)."""
        idle = not (self.waiting or self.running or self._inflight is not None)
        self._collect_compiles(wait=0.02 if idle else 0.0)

    def _step(self) -> list[TokenEvent]:
        trace = self.trace
        self._clock = trace.begin() if trace is not None else None
        lockstep = not self.overlap or self._lockstep_reqs > 0
        events = self._drain() if lockstep else []
        batch = self._schedule(events)
        if batch is None:
            self._clock = None
            return events if lockstep else self._drain()
        if lockstep:
            return events + self._process(batch, self._launch(batch, lambda: self._mask(batch)))
        # The next mask needs the in-flight step's tokens (and its host buffer free again): N+1's forward is
        # enqueued first, then N is read before N+1's mask is filled.
        wait = self._inflight is not None and _constrained(self._inflight[0]) and _constrained(batch)

        def before_sample() -> TokenMask | None:
            # Called by the engine once this batch's forward is enqueued: reading the batch in
            # flight here overlaps that host sync and the matchers' work with the forward.
            if wait:
                for req in batch.reqs:
                    req.cached_len = req.device_len
                events.extend(self._drain())
            return self._mask(batch)

        pending = self._launch(batch, before_sample)
        events.extend(self._drain())
        self._inflight = (batch, pending)
        return events

    def close(self) -> None:
        """Finish the step trace (if any): its last lines are written and the file closed; stop the grammar
        thread and the backend's own helpers."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        if self._compile_thread is not None:
            self._compile_thread.shutdown(wait=False, cancel_futures=True)
            self._compile_thread = None
        if self.grammar is not None:
            self.grammar.close()

    def _trace_fields(self, batch: Batch) -> dict[str, Any]:
        """The step's composition and gauges for its trace line (before its launch)."""
        prefill = [r for r in batch.reqs if not r.is_decoding]
        n_decode = batch.size - len(prefill)
        prefill_tokens = sum(r.extend_len for r in prefill)
        return {
            "kind": "decode" if not prefill else ("mixed" if n_decode else "prefill"),
            "reqs": batch.size,
            "prefill_reqs": len(prefill),
            "decode_reqs": n_decode,
            "tokens": prefill_tokens + n_decode,
            "prefill_tokens": prefill_tokens,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "free_pages": self.kv.free_pages,
            "reserved_pages": self.kv.reserved_pages,
        }

    def _eager_event(self, batch: Batch, fields: dict[str, Any]) -> str:
        """The trace event of a CUDA step that replayed no graph: a decode batch past the largest graph (or no
        graphs), a prefill batch past the largest prefill graph's token count (or none)."""
        engine = self.engine
        if batch.is_decode:
            return f"graph_miss:bs={batch.size}" if engine.graphs is not None else "eager"
        return f"prefill_eager:tokens={fields['tokens']}" if engine.prefill_graphs is not None else "prefill_eager"

    def _prepare(self, batch: Batch) -> StepInputs:
        """Allocate KV slots for the batch's new tokens; the engine's inputs for it."""
        for req in batch.reqs:
            self.kv.allocate(req, req.device_len)
        if batch.is_prefill:
            self.stats["computed_prompt_tokens"] += sum(r.extend_len for r in batch.reqs if not r.is_decoding)
        return self.engine.prepare(batch, self.kv.take_new_entries(batch.reqs))

    def _launch(self, batch: Batch, before_sample: Callable[[], TokenMask | None]) -> PendingStep:
        inputs = self._prepare(batch)
        clock, trace = self._clock, self.trace
        self._clock = None
        if clock is None or trace is None:
            pending = self.engine.launch(batch, inputs, before_sample)
        else:
            fields = self._trace_fields(batch)
            gpu = trace.gpu_events()
            if gpu is not None:
                gpu[0].record()
            clock.launch_began, clock.launch_waited = time.perf_counter(), clock.waited
            self._clock = clock  # the launch may read the batch in flight (before_sample): its wait is counted
            pending = self.engine.launch(batch, inputs, before_sample)
            self._clock = None
            if gpu is not None:
                gpu[1].record()
            clock.launched = time.perf_counter()
            if self.engine.device.type == "cuda" and not self.engine.last_launch_replayed:
                clock.events.append(self._eager_event(batch, fields))
            trace.record(clock, fields, gpu)
        # The KV of these positions is (or, on the device queue, will be) written.
        for req in batch.reqs:
            req.cached_len = req.device_len
        return pending

    def _mask(self, batch: Batch) -> TokenMask | None:
        """The grammar mask of the batch's sampling rows (None when none is constrained)."""
        if self.grammar is None:
            return None
        sampling = [r for r, s in zip(batch.reqs, batch.sample_mask, strict=False) if s]
        rows = [(i, r.matcher) for i, r in enumerate(sampling) if r.matcher is not None]
        mask = self.grammar.fill(rows, len(sampling))
        if mask is not None and mask.late:
            budget = self.grammar.limits.mask_seconds
            for row in mask.late:
                req = sampling[row]
                logger.warning(
                    "request %s: its grammar took longer than %g s (--grammar-mask-timeout) for one token's mask; "
                    "ending it with grammar_error",
                    req.rid,
                    budget,
                )
                self._late.add(req.rid)
            if not mask.rows:
                return None  # only late rows: nothing to apply
        return mask

    def _drain(self) -> list[TokenEvent]:
        """Process the batch in flight, if any."""
        if self._inflight is None:
            return []
        batch, pending = self._inflight
        self._inflight = None
        return self._process(batch, pending)

    # ------------------------------------------------------------------ policy
    def _schedule(self, events: list[TokenEvent]) -> Batch | None:
        """This step's batch; the events of a batch in flight that had to be read first are added to ``events``."""
        if not self.config.mixed_prefill:
            prefill = self._schedule_prefill(admit=True, decoding=None)
            if prefill:
                return Batch(prefill, "prefill", sample_mask=[r.device_len == r.fill_len for r in prefill])
            decodes, _ = self._schedule_decodes(events)
            return Batch(decodes, "decode", sample_mask=[True] * len(decodes)) if decodes else None
        decodes, preempted = self._schedule_decodes(events)
        # No admission in a step that preempted: the pages it freed are for the running requests' growth.
        prefill = self._schedule_prefill(admit=not preempted, decoding=len(decodes))
        if prefill:
            reqs = decodes + prefill
            mask = [True] * len(decodes) + [r.device_len == r.fill_len for r in prefill]
            return Batch(reqs, "prefill", sample_mask=mask)
        return Batch(decodes, "decode", sample_mask=[True] * len(decodes)) if decodes else None

    def _decodable(self) -> list[Req]:
        # Tokens sampled so far, the one of a batch in flight included, are cached_len - prompt_len + 1;
        # a request at its max_new_tokens is done even if the host has not seen its last token yet.
        return [r for r in self.running if r.is_decoding and r.cached_len - r.prompt_len + 1 < r.max_new_tokens]

    def _schedule_decodes(self, events: list[TokenEvent]) -> tuple[list[Req], bool]:
        """The requests that decode this step, their next slots allocated, preempting the newest running requests
        while the spare pages cannot hold that growth; and whether any was preempted."""
        decodes = self._decodable()
        preempted = 0
        while decodes and sum(self.kv.growth_pages(r, r.cached_len + 1) for r in decodes) > self.kv.spare_pages:
            if self._inflight is not None:  # its tokens first: a preempted request keeps all it sampled
                events.extend(self._drain())
                decodes = self._decodable()
                continue
            victim = next(r for r in reversed(self._by_rid.values()) if r.status is ReqStatus.RUNNING)
            self._preempt(victim)
            preempted += 1
            if victim in decodes:
                decodes.remove(victim)
        if preempted and self._clock is not None:
            self._clock.events.append(f"preempt:{preempted}")
        for r in decodes:
            r.device_len = r.cached_len + 1
            self.kv.allocate(r, r.device_len)
        return decodes, preempted > 0

    def _preempt(self, req: Req) -> None:
        """Retract running ``req``: its pages go back (its computed prefix to the prefix cache); it keeps its
        output and waits at the front of the queue, to compute its prompt and output again when re-admitted."""
        self.running.remove(req)
        self.stats["recomputed_tokens"] += req.cached_len
        self.kv.release(req)
        req.fill_len = req.total_len
        req.cached_len = req.device_len = 0
        req.preemptions += 1
        req.status = ReqStatus.WAITING
        self._enqueue(req, front=True)
        self.stats["preemptions"] += 1

    def _reserve_len(self, req: Req) -> int:
        """Positions ``req`` reserves pages for at admission: its prefill and the estimate of its growth."""
        return req.fill_len + min(self.config.admit_reserve_tokens, req.tokens_left)

    def _schedule_prefill(self, *, admit: bool, decoding: int | None) -> list[Req]:
        """Requests computing prefill tokens this step (``device_len`` set), up to ``chunked_prefill_size`` of
        them (the throughput policy paces them beside ``decoding`` decodes; None: a prefill-only step);
        ``admit``: new requests may join."""
        if self._waiting_unsorted:
            self._order_longest_first()
        budget = self.config.chunked_prefill_size
        if self._longest_first and decoding is not None:
            budget = self._paced_budget(decoding, budget)
        reqs: list[Req] = []
        # A request whose prefill was chunked continues first.
        for req in self.running:
            if budget <= 0:
                break
            if req.cached_len < req.fill_len:
                req.device_len = req.cached_len + min(req.fill_len - req.cached_len, budget)
                budget -= req.extend_len
                reqs.append(req)
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if reqs and self._waits_for_batch_prefix(req, reqs):
                break
            prefix_len = req.prefix_len
            if not self.kv.try_admit(req, self._reserve_len(req)):
                if self._clock is not None:
                    self._clock.events.append("admit_blocked")
                break
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            if req.preemptions:
                req.prefix_len = prefix_len  # what the client is told was cached: the first admission's
            else:
                self.stats["cached_prompt_tokens"] += req.prefix_len
            req.device_len = req.cached_len + min(req.fill_len - req.cached_len, budget)
            budget -= req.extend_len
            reqs.append(req)
        return reqs

    def _order_longest_first(self) -> None:
        """Order the queue for the throughput policy: preempted requests first (as they were), then the most
        output tokens to go first; ties keep their arrival order."""
        queued = sorted(self.waiting, key=lambda r: (r.preemptions == 0, -r.tokens_left))
        self.waiting.clear()
        self.waiting.extend(queued)
        self._waiting_unsorted = False

    def _paced_budget(self, decoding: int, limit: int) -> int:
        """The throughput policy's prompt tokens for a step with ``decoding`` decodes, at most ``limit``.

        Enough to fill the step to ``throughput_step_tokens``, or more where a request must start sooner: the
        longest running request ends in ``horizon`` steps, and a request with ``n`` output tokens to go starts
        decoding by step ``horizon - n`` only if the prompt tokens queued up to it are computed by then. Only the
        requests that could be admitted now are counted (the others wait for a running one to end anyway). Then
        up to the rows the step computes anyway (:meth:`~minisgl.engine.Engine.prefill_step_tokens`).
        """
        cfg = self.config
        fill = cfg.throughput_step_tokens - decoding
        if fill >= limit:
            return limit
        running = self.running
        partial = [r for r in running if r.cached_len < r.fill_len]
        if not partial and not self.waiting:
            return max(1, fill)
        queued = list(itertools.islice(self.waiting, max(0, cfg.max_running_requests - len(running))))
        # Plain loops with ``tokens_left`` written out: this runs every step while prompts wait (a few hundred
        # requests), and the property calls would cost a third more.
        horizon = 0
        for r in itertools.chain(running, queued):
            left = r.max_new_tokens - len(r.output_ids)
            if left > horizon:
                horizon = left
        horizon -= _PACE_MARGIN_STEPS
        need = 0.0
        tokens = 0
        for r in partial + queued:
            tokens += r.fill_len - r.cached_len
            steps = horizon - r.max_new_tokens + len(r.output_ids)
            rate = tokens / steps if steps > 1 else tokens
            if rate > need:
                need = rate
        budget = max(1, min(limit, max(fill, math.ceil(need))))
        # A step padded to a prefill graph's size runs its padding rows through the GEMMs anyway: fill them.
        return min(limit, self.engine.prefill_step_tokens(decoding + budget) - decoding)

    def _waits_for_batch_prefix(self, req: Req, batch: list[Req]) -> bool:
        """Whether ``req`` waits (and so the queue behind it) for a longer prefix of its prompt that ``batch``
        computes than the prefix cache holds: requests sharing a system prompt compute it once."""
        if not self.kv.cache.reuses_prefixes:
            return False
        limit = req.prompt_len - 1  # the last prompt token is always computed
        shared = max(
            _common_prefix_len(req.input_ids, other.input_ids, min(limit, other.device_len)) for other in batch
        )
        shared -= shared % self.kv.page_size
        return shared > 0 and shared > self.kv.cached_prefix_len(req.input_ids[:limit])

    def _process(self, batch: Batch, pending: PendingStep) -> list[TokenEvent]:
        if self._clock is not None:
            t0 = time.perf_counter()
            result = pending.result()
            self._clock.waited += time.perf_counter() - t0
        else:
            result = pending.result()
        events: list[TokenEvent] = []
        it = iter(zip(result.tokens, result.logprobs, strict=False))
        for req, samples in zip(batch.reqs, batch.sample_mask, strict=False):
            if not samples:
                continue
            token, lp = next(it)
            if req.is_finished:  # aborted while the batch ran
                continue
            if self._late and req.rid in self._late:
                self._late.discard(req.rid)
                req.matcher = None  # its fill may still be running: never used again
                if self._end_late(req):
                    events.append(TokenEvent(req, None, None, True))
                continue
            req.output_ids.append(token)
            if req.matcher is not None and not req.matcher.accept_token(token):
                # With the mask applied, only when the grammar allows no token at all (no string satisfies it).
                logger.warning("request %s: the grammar rejected sampled token %d; finishing it", req.rid, token)
                req.matcher = None
            if lp is not None:
                req.logprobs.append(lp)
            self.stats["generated_tokens"] += 1
            reason = self._finish_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
            events.append(TokenEvent(req, token, lp, req.is_finished))
        return events

    def _end_late(self, req: Req) -> bool:
        """End ``req``, whose mask was late (what was sampled for it is discarded); whether it ended now."""
        self._finish(req, "grammar_error")
        return True

    def _finish_reason(self, req: Req, token: int) -> str | None:
        if req.params.grammar is not None and req.matcher is None:
            return "grammar_error"  # the grammar allowed no token here: the output does not match it
        if token in req.eos_token_ids or token in req.params.stop_ids:
            return "stop"
        if req.matcher is not None and req.matcher.is_terminated():
            return "stop"  # the grammar is complete
        stops = req.params.stop_strings
        if stops and self.detokenize is not None:
            tail = self.detokenize(req.output_ids[-(max(len(s) for s in stops) + 8) :])
            if any(s in tail for s in stops):
                return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _finish(self, req: Req, reason: str) -> None:
        """Take ``req`` off its queue (returning its pages if it ran) and mark it finished."""
        if req.status is ReqStatus.COMPILING:
            self._compiles.pop(req.rid, None)  # its compile finishes on its own; the result is dropped
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            # A late mask's token is discarded after, with overlap, the next step was fed it: that KV position
            # holds no token of the request, and the prefix cache must not be given it.
            req.cached_len = min(req.cached_len, len(req.input_ids) + len(req.output_ids))
            self.kv.release(req)
        if _needs_lockstep(req):
            self._lockstep_reqs -= 1
        self._late.discard(req.rid)
        req.matcher = None
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.stats["prompt_tokens"] += req.prompt_len
        self._by_rid.pop(req.rid, None)

    def check_accounting(self) -> None:
        """Assert exact KV page accounting over the live requests."""
        self.kv.check_accounting(self.running)


def _common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (slice comparisons run in C)."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _constrained(batch: Batch) -> bool:
    """Whether a grammar constrains a token ``batch`` samples."""
    return any(r.matcher is not None for r, s in zip(batch.reqs, batch.sample_mask, strict=False) if s)


def _needs_lockstep(req: Req) -> bool:
    """Whether sampling ``req`` reads its output history or reports logprobs (host-side work)."""
    return req.params.has_penalty or req.params.logprobs is not None
