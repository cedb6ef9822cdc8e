"""Token sampling on the device: logit bias, grammar masks, penalties, temperature, top-k/p, min-p, seeds,
logprobs."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core import LOGPROB_FLOOR, Req, SamplingParams, TokenLogprob
from ..kernel import KernelSet, select_kernels

if TYPE_CHECKING:
    from .grammar import TokenMask

_SEED_MIX = 0x9E3779B97F4A7C15


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without stalling the host: pinned, non-blocking on CUDA."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [N] int64, on the device
    logprobs: list[TokenLogprob | None]


class Sampler:
    """One token per row of a logits matrix, each with its request's params. Unseeded rows draw from this
    sampler's generator (two engines never share random state); a row with a ``seed`` uses noise derived
    from ``(seed, step)`` only, independent of the rest of the batch."""

    def __init__(self, device: torch.device, seed: int = 0, kernels: KernelSet | None = None):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.kernels = kernels or select_kernels(device, torch.float32)  # logits are sampled in float32
        self._seeds = random.Random(seed)  # seeds of the one-pass sampler, drawn on the host

    def sample(self, logits: torch.Tensor, reqs: list[Req], mask: TokenMask | None = None) -> SampleResult:
        """One token per row. ``mask``: the grammar mask of the constrained rows, applied (with each
        row's ``logit_bias``) before everything else, logprobs included."""
        biased = any(r.params.logit_bias for r in reqs)
        if mask is not None or biased:
            # A copy only when not float32 or not row-major (the mask kernels want contiguous rows; CPU
            # matmuls can return the logits transposed); otherwise in place: the logits are this step's alone.
            logits = logits.float().contiguous()
            if biased:
                self._apply_bias(logits, reqs)
            if mask is not None:
                mask.apply(logits)
        fused = self.kernels.gumbel_sample  # plain temperature/greedy rows in one pass (e.g. the triton kernel set)
        if fused is not None and mask is None and not biased and all(_plain(r.params) for r in reqs):
            inv = [0.0 if r.params.greedy else 1.0 / r.params.temperature for r in reqs]
            tokens = fused(logits, to_device(inv, torch.float32, logits.device), self._seeds.randrange(1 << 31))
            logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        else:
            raw = logits.float()
            logits = self._apply_penalties(raw.clone(), reqs) if any(r.params.has_penalty for r in reqs) else raw
            greedy = [r.params.greedy for r in reqs]
            tokens = self.kernels.argmax(logits) if all(greedy) else self._sample_random(logits, reqs, greedy)
            logprobs = self._logprobs(raw, tokens, reqs)
        for r in reqs:
            r.step_seed += 1
        return SampleResult(tokens, logprobs)

    def _sample_random(self, logits: torch.Tensor, reqs: list[Req], greedy: list[bool]) -> torch.Tensor:
        vocab, dev = logits.shape[1], logits.device
        temps = to_device([1.0 if r.params.greedy else r.params.temperature for r in reqs], torch.float32, dev)
        scaled = logits / temps.view(-1, 1)
        if any(r.params.top_k > 1 or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in reqs):
            scaled = self._filter(scaled, reqs)
        probs = torch.softmax(scaled, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.params.seed is not None and not greedy[i]:
                g = torch.Generator(device=dev)
                g.manual_seed((r.params.seed * _SEED_MIX + r.step_seed) & 0x7FFF_FFFF_FFFF_FFFF)
                noise[i] = torch.empty(vocab, device=dev).exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(to_device(greedy, torch.bool, dev), self.kernels.argmax(logits), sampled)
        return sampled

    @staticmethod
    def _filter(scaled: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        vocab, dev = scaled.shape[1], scaled.device
        top_k = to_device([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], torch.int64, dev)
        top_p = to_device([r.params.top_p for r in reqs], torch.float32, dev)
        min_p = to_device([r.params.min_p for r in reqs], torch.float32, dev)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev).view(1, -1)
        remove = ranks >= top_k.view(-1, 1)
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        remove |= (probs.cumsum(dim=-1) - probs) >= top_p.view(-1, 1)
        remove |= probs < min_p.view(-1, 1) * probs[:, :1]
        remove[:, 0] = False
        filtered = sorted_logits.masked_fill(remove, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, filtered)

    @staticmethod
    def _apply_bias(logits: torch.Tensor, reqs: list[Req]) -> None:
        bias = [(i, t, b) for i, r in enumerate(reqs) for t, b in (r.params.logit_bias or {}).items()]
        rows, cols, vals = (list(column) for column in zip(*bias, strict=True))
        dev = logits.device
        index = (to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev))
        logits.index_put_(index, to_device(vals, torch.float32, dev), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(reqs):
            p = r.params
            if not p.has_penalty:
                continue
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.input_ids) | set(r.output_ids)), dtype=torch.int64, device=row.device)
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if r.output_ids and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
                out = torch.tensor(r.output_ids, dtype=torch.int64, device=row.device)
                counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, reqs: list[Req]) -> list[TokenLogprob | None]:
        """The logprob of each sampled token and the top ones, from ``raw`` (before penalties), for rows that ask."""
        want = [r.params.logprobs for r in reqs]
        if all(w is None for w in want):
            return [None] * len(reqs)
        log_probs = torch.log_softmax(raw, dim=-1)
        # A chosen token is allowed, so its logprob is finite, unless the mask allowed nothing (a grammar at a
        # dead end: every logit -inf, the softmax NaN); OpenAI's floor stands in for it then.
        picked = log_probs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
        chosen = [lp if math.isfinite(lp) else LOGPROB_FLOOR for lp in picked]
        vals, ids = log_probs.topk(max(w for w in want if w is not None), dim=-1)
        # A token the mask forbids (-inf) is no alternative: a row with fewer allowed tokens lists fewer.
        top = [
            [(t, v) for t, v in zip(i, vs, strict=True) if math.isfinite(v)]
            for i, vs in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
        return [
            None if w is None else TokenLogprob(token, lp, top[i][:w])
            for i, (w, token, lp) in enumerate(zip(want, tokens.tolist(), chosen, strict=True))
        ]


def _plain(p: SamplingParams) -> bool:
    """Temperature (or greedy) sampling only: no filters, penalties, seed or logprobs."""
    if p.has_penalty or p.logprobs is not None:
        return False
    return p.greedy or (p.top_k in (-1, 0) and p.top_p >= 1.0 and p.min_p <= 0.0 and p.seed is None)
