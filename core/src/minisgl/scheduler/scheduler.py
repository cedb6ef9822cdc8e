"""Continuous batching with chunked prefill and admission by KV capacity.

Each :meth:`Scheduler.step` runs one batch: a prefill batch when any request
has prompt tokens left to compute (under the ``chunked_prefill_size`` token
budget), otherwise a decode batch of every running request. Requests are
admitted first come, first served while a table row and enough KV pages
(prompt plus ``max_new_tokens``, see :mod:`minisgl.kvcache.manager`) are free.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core import Batch, Req, ReqStatus, SamplingParams, TokenLogprob, ValidationError
from ..engine import Engine

Detokenize = Callable[[Sequence[int]], str]


@dataclass
class TokenEvent:
    """One request's progress in one step: a new token, and whether it finished."""

    req: Req
    token: int | None
    logprob: TokenLogprob | None
    finished: bool


class Scheduler:
    """Drives an :class:`Engine`: admission, batching, finishing and abort."""

    def __init__(self, engine: Engine, *, eos_token_ids: Sequence[int] = (), detokenize: Detokenize | None = None):
        self.engine = engine
        self.kv = engine.kv
        self.config = engine.config
        self.eos_token_ids = tuple(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._by_rid: dict[int, Req] = {}
        self._rids = itertools.count()
        self.vocab_size = int(engine.hf_config.vocab_size)
        self.stats = {"prompt_tokens": 0, "computed_prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0}

    # -------------------------------------------------------------- requests
    def add_request(self, input_ids: Sequence[int], params: SamplingParams, rid: int | None = None) -> Req:
        """Validate and queue a request; :class:`ValidationError` if it can never run."""
        ids = [int(t) for t in input_ids]
        max_len = self.engine.max_model_len
        if not ids:
            raise ValidationError("prompt", "the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValidationError("prompt", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= max_len:
            raise ValidationError(
                "prompt", f"the prompt has {len(ids)} tokens, but the context length is {max_len} (leave room for output)"
            )
        max_new = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_new > max_len:
            raise ValidationError(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) = {len(ids) + max_new} "
                f"exceeds the context length {max_len}",
            )
        req = Req(
            rid=next(self._rids) if rid is None else rid,
            input_ids=ids,
            params=params,
            max_new_tokens=max_new,
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
        self._by_rid[req.rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: int) -> Req | None:
        """Finish request ``rid`` now ("abort"), returning its pages. None if unknown or done."""
        req = self._by_rid.get(rid)
        if req is None or req.is_finished:
            return None
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.kv.release(req)
        self._finish(req, "abort")
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenEvent]:
        """Run one batch; return what happened to each request in it."""
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None:
            return []
        self._prepare(batch)
        result = self.engine.forward(batch)
        return self._process(batch, result.tokens, result.logprobs)

    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.chunked_prefill_size
        reqs: list[Req] = []
        # A request whose prompt was chunked continues first.
        for req in self.running:
            if budget <= 0:
                break
            if req.cached_len < req.prompt_len:
                req.device_len = req.cached_len + min(req.prompt_len - req.cached_len, budget)
                budget -= req.extend_len
                reqs.append(req)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self.kv.try_admit(req):
                break
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            self.stats["cached_prompt_tokens"] += req.prefix_len
            req.device_len = req.cached_len + min(req.prompt_len - req.cached_len, budget)
            budget -= req.extend_len
            reqs.append(req)
        if not reqs:
            return None
        return Batch(reqs, "prefill", sample_mask=[r.device_len == r.prompt_len for r in reqs])

    def _schedule_decode(self) -> Batch | None:
        reqs = [r for r in self.running if r.cached_len >= r.prompt_len]
        if not reqs:
            return None
        for r in reqs:
            r.device_len = r.total_len
        return Batch(reqs, "decode", sample_mask=[True] * len(reqs))

    def _prepare(self, batch: Batch) -> None:
        dev = self.engine.device
        ids: list[int] = []
        pos: list[int] = []
        locs: list[torch.Tensor] = []
        for req in batch.reqs:
            locs.append(self.kv.allocate(req, req.device_len))
            all_ids = req.all_ids
            ids.extend(all_ids[req.cached_len : req.device_len])
            pos.extend(range(req.cached_len, req.device_len))
        batch.input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        batch.positions = torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True)
        batch.out_loc = torch.cat(locs).to(dev, non_blocking=True)
        if batch.is_prefill:
            computed = sum(r.extend_len for r in batch.reqs)
            self.stats["computed_prompt_tokens"] += computed

    def _process(self, batch: Batch, tokens: list[int], logprobs: list[TokenLogprob | None]) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        it = iter(zip(tokens, logprobs))
        for req, samples in zip(batch.reqs, batch.sample_mask):
            req.cached_len = req.device_len
            if not samples:
                continue
            token, lp = next(it)
            if req.is_finished:  # aborted while the batch ran
                continue
            req.output_ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            self.stats["generated_tokens"] += 1
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.running.remove(req)
                self.kv.release(req)
                self._finish(req, reason)
            events.append(TokenEvent(req, token, lp, req.is_finished))
        return events

    def _finish_reason(self, req: Req, token: int) -> str | None:
        if token in req.eos_token_ids or token in req.params.stop_ids:
            return "stop"
        if req.params.stop_strings and self.detokenize is not None and self._hits_stop_string(req):
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _hits_stop_string(self, req: Req) -> bool:
        assert self.detokenize is not None
        stops = req.params.stop_strings
        window = max(len(s) for s in stops) + 8
        tail = self.detokenize(req.output_ids[-window:])
        return any(s in tail for s in stops)

    def _finish(self, req: Req, reason: str) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.stats["prompt_tokens"] += req.prompt_len
        self._by_rid.pop(req.rid, None)

    # ------------------------------------------------------------ accounting
    def check_accounting(self) -> None:
        """Assert exact KV page accounting over the live requests."""
        self.kv.check_accounting(self.running)
