"""Which FP8 GEMM runs at which token count, measured on the GPU when a model loads.

No one FP8 GEMM is the fastest everywhere: at a few tokens the matmul is bound by reading the weight, at
thousands by the tensor cores, and which library kernel wins in between depends on the GPU, the driver and the
shape. So for each distinct layer shape the method times its candidates (:class:`Candidate`) once, at a
token count per bucket (:data:`BUCKETS`; anything larger uses the last), and every layer of that shape then
runs the fastest one for its bucket (:class:`GemmTable`). Each candidate is first checked against the
de-quantized weight's product (relative error under :data:`MAX_REL_ERR`): a kernel that fails or is wrong on
this GPU is left out, never chosen. Small token counts are timed inside CUDA graphs, as the decode graphs
run them (otherwise the host's launch cost would decide). One :class:`GemmTuner` belongs to one engine's
method, so two engines in a process tune (and remember) independently.
"""

from __future__ import annotations

import bisect
import functools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.layers import LinearInput

logger = logging.getLogger(__name__)

#: (x, weight, scale, bias) -> y: one GEMM, as the method's layers call it (``x``: a tensor, or for a per-token
#: GEMM the activation its producer already quantized).
Gemm = Callable[[LinearInput, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
#: (fn, tokens) -> median milliseconds of one call of ``fn``.
Timer = Callable[[Callable[[], object], int], float]

#: Token counts timed; a GEMM of ``m`` tokens runs the choice of the first bucket >= m (the last beyond it).
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Up to this many tokens, candidates are timed inside a CUDA graph (the launch cost left out).
GRAPH_MAX_TOKENS = 512
#: A candidate whose output is further than this from the de-quantized weight's product is not used (FP8
#: activations alone cost 3-4 % RMS; see tests/test_fp8_gpu.py).
MAX_REL_ERR = 0.08


@dataclass(frozen=True)
class Candidate:
    """One GEMM the tuner may choose, tried at the token counts ``fits`` accepts."""

    name: str
    gemm: Gemm
    fits: Callable[[int], bool] = field(default=lambda m: True)


@dataclass(frozen=True)
class GemmTable:
    """A layer's GEMM per token-count bucket: ``gemms[i]`` for ``m <= buckets[i]`` (the last for larger)."""

    buckets: tuple[int, ...]
    names: tuple[str, ...]
    gemms: tuple[Gemm, ...]

    @classmethod
    def single(cls, candidate: Candidate) -> GemmTable:
        return cls((BUCKETS[-1],), (candidate.name,), (candidate.gemm,))

    def pick(self, m: int) -> Gemm:
        return self.gemms[min(bisect.bisect_left(self.buckets, m), len(self.gemms) - 1)]

    def name_at(self, m: int) -> str:
        return self.names[min(bisect.bisect_left(self.buckets, m), len(self.names) - 1)]

    def describe(self) -> str:
        return describe(self.buckets, self.names)


def describe(buckets: Sequence[int], names: Sequence[str]) -> str:
    """``<=64 w8a8, <=512 scaled_mm, >512 tensor_epi``: each choice with the largest token count it runs at
    (neighbouring buckets with one choice merged; the last choice also runs at any larger count)."""
    runs: list[tuple[str, int]] = []  # (name, index of the run's last bucket)
    for i, name in enumerate(names):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, i)
        else:
            runs.append((name, i))
    if len(runs) == 1:
        return f"any {runs[0][0]}"
    parts = [f"<={buckets[end]} {name}" for name, end in runs[:-1]]
    return ", ".join([*parts, f">{buckets[runs[-2][1]]} {runs[-1][0]}"])


class GemmTuner:
    """Times candidates once per layer shape (``key``) and remembers the table; ``timer`` replaces the CUDA
    timing (tests)."""

    def __init__(self, buckets: Sequence[int] = BUCKETS, timer: Timer | None = None) -> None:
        self.buckets = tuple(buckets)
        self._timer = timer
        self._tables: dict[Any, tuple[str, ...]] = {}
        #: One row per (shape, bucket, candidate): the layer shape's ``key``, the token count ``m``, the weight's
        #: ``n`` x ``k``, the ``candidate`` and its ``ms`` and ``rel_err``, or why it was ``skipped`` (for logs and
        #: benchmarks: ``minisgl bench offline`` records them as ``gemm_timings``).
        self.results: list[dict[str, Any]] = []

    def summary(self) -> dict[str, str]:
        """What each tuned layer shape runs, ``{str(key): "<=64 w8a8_..., >64 scaled_mm_fast"}`` (benchmarks)."""
        return {str(key): describe(self.buckets, names) for key, names in self._tables.items()}

    def table(
        self,
        key: Any,
        candidates: Sequence[Candidate],
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        reference: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
    ) -> GemmTable:
        """The table of the layer shape ``key`` (tuned on its first layer) for activations of ``dtype``:
        ``reference(x)`` is the exact product the candidates approximate; ``candidates[0]`` is the default,
        used where no candidate works."""
        by_name = {c.name: c for c in candidates}
        names = self._tables.get(key)
        if names is None or any(n not in by_name for n in names):
            names = self._tables[key] = self._tune(key, candidates, (weight, scale, bias), reference, dtype)
        return GemmTable(self.buckets, names, tuple(by_name[n].gemm for n in names))

    def _tune(
        self,
        key: Any,
        candidates: Sequence[Candidate],
        args: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        reference: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
    ) -> tuple[str, ...]:
        """The fastest working candidate's name per bucket (``args``: the layer's weight, scale and bias)."""
        started = time.perf_counter()
        weight, k = args[0], args[0].shape[1]
        timer = self._timer or cuda_timer
        names = []
        gen = torch.Generator(device=weight.device).manual_seed(0)
        for m in self.buckets:
            x = torch.randn(m, k, device=weight.device, dtype=dtype, generator=gen)
            ref = reference(x).float()
            best, best_ms = candidates[0].name, float("inf")
            for cand in candidates:
                row: dict[str, Any] = {"key": str(key), "m": m, "n": weight.shape[0], "k": k, "candidate": cand.name}
                if not cand.fits(m):
                    continue
                try:
                    err = float((cand.gemm(x, *args).float() - ref).norm() / ref.norm().clamp_min(1e-30))
                    if not err <= MAX_REL_ERR:  # also NaN
                        row["skipped"] = f"relative error {err:.3g} > {MAX_REL_ERR}"
                    else:
                        row["ms"] = ms = timer(functools.partial(cand.gemm, x, *args), m)
                        row["rel_err"] = err
                        if ms < best_ms:
                            best, best_ms = cand.name, ms
                except Exception as exc:  # a kernel this GPU, driver or shape cannot run: never chosen
                    row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                self.results.append(row)
            names.append(best)
            del x, ref  # the engine empties the allocator's cache before it sizes the KV pool
        took = time.perf_counter() - started
        logger.info("fp8 GEMM %s: %s (tuned in %.1f s)", key, describe(self.buckets, names), took)
        skipped = {r["candidate"]: r["skipped"] for r in self.results if r["key"] == str(key) and "skipped" in r}
        for name, why in skipped.items():
            logger.info("fp8 GEMM %s: %s left out (%s)", key, name, why)
        return tuple(names)


def cuda_timer(
    fn: Callable[[], object], m: int, calls: int = 10, repeats: int = 5, graph_timing: bool | None = None
) -> float:
    """Median milliseconds per call of ``fn`` on the current CUDA device: ``calls`` calls captured in one CUDA
    graph and replayed ``repeats`` times (the decode graphs' view, which leaves the host's launch cost out), or
    ``calls`` eager calls between two events, ``repeats`` times. ``graph_timing`` None: graphs for up to
    :data:`GRAPH_MAX_TOKENS` tokens ``m``."""
    fn()  # compiles a Triton kernel on first use, outside the graph
    torch.cuda.synchronize()
    graph = None
    if m <= GRAPH_MAX_TOKENS if graph_timing is None else graph_timing:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(calls):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)
