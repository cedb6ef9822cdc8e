"""CUDA-graph capture and replay: a small model's step is hundreds of short kernels, cheaper to replay than to
launch from Python. Decode steps: each size of :func:`graph_batch_sizes` gets one graph (forward and LM head)
over static inputs; a batch replays the smallest graph that fits, padded with dummy entries that write to
scratch slot 0. Prefill and mixed steps: :class:`PrefillGraphRunner` replays everything but attention, per
token count of :func:`graph_token_sizes`. The graphs of one runner share one memory pool: they never run at once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core import Batch
from ..layers import ForwardContext

if TYPE_CHECKING:
    from ..attention import BaseAttnBackend
    from ..kvcache import BaseKVPool
    from ..models import CausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))
    return sorted(set(sizes) | {max_bs})


class CudaGraphRunner:
    """Captured decode graphs for a set of batch sizes, replayed with padding."""

    def __init__(self, model: CausalLM, attn: BaseAttnBackend, *, max_bs: int, max_seq_len: int, device: torch.device):
        self.model = model
        self.attn = attn
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        # The static inputs: input ids, positions and out_loc, one row each.
        self.inputs = torch.zeros((3, self.max_bs), dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        attn.init_capture_graph(max_seq_len, self.batch_sizes)
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        self._capture_all()
        self.capture_seconds = time.perf_counter() - t0
        used_gib = (free_before - torch.cuda.mem_get_info(device)[0]) / (1 << 30)
        msg = "captured %d decode CUDA graphs (batch sizes %d..%d) in %.2fs, using %.2f GiB"
        logger.info(msg, len(self.graphs), self.batch_sizes[0], self.max_bs, self.capture_seconds, used_gib)

    def _run(self, batch: Batch) -> torch.Tensor:
        assert batch.input_ids is not None and batch.positions is not None
        hidden = self.model(batch.input_ids, batch.positions, ForwardContext(batch, self.attn))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.device)
        # Largest first, so smaller graphs fit into the pool the largest one sized.
        for bs in reversed(self.batch_sizes):
            ids, pos, loc = self.inputs[:, :bs]
            batch = Batch(reqs=[], phase="decode", input_ids=ids, positions=pos, out_loc=loc, padded_size=bs)
            self.attn.prepare_for_capture(batch)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._run(batch)  # warm-up outside the graph: lazy library initialisation
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self._run(batch)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def replay(self, batch: Batch) -> torch.Tensor:
        """Logits ``[batch.size, vocab]`` of decode ``batch`` (tensors prepared, on the device)."""
        n = batch.size
        bs = next(s for s in self.batch_sizes if s >= n)
        batch.padded_size = bs
        assert batch.input_ids is not None and batch.positions is not None and batch.out_loc is not None
        for static, value in zip(self.inputs, (batch.input_ids, batch.positions, batch.out_loc), strict=True):
            static[:n].copy_(value)
        # Padding requests: token 0 at position 0, writing to the never-allocated scratch slot 0.
        self.inputs[:, n:bs].zero_()
        self.attn.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.logits[bs][:n]


def graph_token_sizes(max_tokens: int) -> list[int]:
    """Token counts with a prefill graph: every 16 up to 256, then a step that doubles with each doubling of the
    count (32 up to 512, 64 up to 1,024, ...), and ``max_tokens`` itself. A batch pads to the next size, so past
    128 tokens padding stays within an eighth of the batch."""
    sizes: list[int] = []
    n = 16
    while n < max_tokens:
        sizes.append(n)
        n += max(16, 1 << (n.bit_length() - 4))  # 16 below 256, then n/8 for n from 2**k to 2**(k+1)
    return sizes + [max_tokens] if max_tokens > 0 else sizes


@dataclass
class _AttentionCall:
    """One attention call of a captured forward: the static tensors it reads and the one it writes."""

    layer_id: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class _PiecewiseGraph:
    """The forward of one token count: ``segments[i]`` runs up to attention call ``i``, the last one to the end."""

    segments: list[torch.cuda.CUDAGraph]
    calls: list[_AttentionCall]


class _AttentionSplit:
    """Stands in for the attention backend while a prefill forward is captured. An attention call copies q, k and
    v into the runner's static buffers and returns its static output buffer; while capturing, it also ends the
    graph being captured there and starts the next, so the attention itself stays out of every graph."""

    def __init__(self, runner: PrefillGraphRunner, rows: int, pool: Any):
        self.runner, self.rows, self.pool = runner, rows, pool
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.segments.append(graph)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        sq, sk, sv, out = self.runner.buffers(q, k, v, self.rows)
        sq.copy_(q)
        sk.copy_(k)
        sv.copy_(v)
        self.runner.store(sk, sv, layer_id, self.rows)
        if self.pool is not None:
            self.segments[-1].capture_end()
            self.calls.append(_AttentionCall(layer_id, sq, sk, sv, out))
            self.begin()
        return out


class PrefillGraphRunner:
    """Prefill and mixed batches up to ``max_tokens`` tokens, replayed from CUDA graphs piece by piece.

    A prefill step cannot be one graph: its attention depends on every request's length, planned per batch on
    the host. Everything else in the forward (embedding, norms, projections, rotary, MLP, the all-reduces of
    tensor parallelism) depends only on the token count. So each size of :func:`graph_token_sizes` is captured
    as one graph per stretch between two attention calls; a replay runs them in turn with the backend's eager
    attention in between, over static q/k/v buffers shared by every layer and size. Without this a small model's
    mixed step is launch-bound: its host launches a few hundred kernels one by one while the GPU waits.

    With ``kv_pool`` and a backend that :attr:`~minisgl.attention.BaseAttnBackend.supports_attend_stored`, each
    piece also stores its layer's K/V (at a static copy of ``out_loc``; the padding tokens' at scratch slot 0),
    and the backend's ``attend_stored`` writes into the static output: between two pieces the host then launches
    the attention kernels and nothing else.

    The model's forward must be capturable apart from its attention calls (what decode graphs need too); the
    tokens past a batch's own, up to its size, run on the previous step's ids and positions and are dropped.
    """

    def __init__(
        self,
        model: CausalLM,
        attn: BaseAttnBackend,
        *,
        max_tokens: int,
        device: torch.device,
        kv_pool: BaseKVPool | None = None,
    ):
        self.model = model
        self.attn = attn
        self.device = device
        self.sizes = graph_token_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        #: The pool the pieces store K/V into (None: the backend's forward stores them, between the pieces).
        self.kv_pool = kv_pool if kv_pool is not None and attn.supports_attend_stored else None
        self.out_loc = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self._buffers: dict[tuple[int, int, int, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.hidden: torch.Tensor | None = None  # the final hidden states, written by every graph's last segment
        self.graphs: dict[int, _PiecewiseGraph] = {}
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        self._capture_all()
        self.capture_seconds = time.perf_counter() - t0
        used_gib = (free_before - torch.cuda.mem_get_info(device)[0]) / (1 << 30)
        pieces = len(next(iter(self.graphs.values())).segments)
        msg = "captured %d prefill CUDA graphs of %d pieces (%d..%d tokens%s) in %.2fs, using %.2f GiB"
        stores = ", K/V stores inside" if self.kv_pool is not None else ""
        args = (len(self.graphs), pieces, self.sizes[0], self.max_tokens, stores, self.capture_seconds, used_gib)
        logger.info(msg, *args)

    def store(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, rows: int) -> None:
        """Inside a piece: layer ``layer_id``'s K/V (``[rows, kv_heads * head_dim]``) into the pool at the static
        ``out_loc``, when the pieces store them."""
        if self.kv_pool is None:
            return
        layout = self.kv_pool.layout
        shape = (rows, layout.num_kv_heads, layout.head_dim)
        self.kv_pool.store_kv(k.view(shape), v.view(shape), self.out_loc[:rows], layer_id)

    def buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """Static q, k, v and output buffers (their first ``rows`` rows) for attention inputs shaped like these."""
        key = (q.shape[-1], k.shape[-1], v.shape[-1], q.dtype)
        if key not in self._buffers:
            n = self.max_tokens
            widths = (q.shape[-1], k.shape[-1], v.shape[-1], q.shape[-1])
            self._buffers[key] = tuple(torch.zeros((n, w), dtype=q.dtype, device=self.device) for w in widths)
        return tuple(b[:rows] for b in self._buffers[key])

    def _forward(self, rows: int, split: _AttentionSplit) -> None:
        batch = Batch(reqs=[], phase="prefill", input_ids=self.ids[:rows], positions=self.positions[:rows])
        hidden = self.model(self.ids[:rows], self.positions[:rows], ForwardContext(batch, split))  # type: ignore[arg-type]
        if self.hidden is None:  # the warm-up of the largest size, outside any graph
            self.hidden = torch.zeros((self.max_tokens, hidden.shape[-1]), dtype=hidden.dtype, device=self.device)
        self.hidden[:rows].copy_(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # Largest first, so smaller sizes fit into the pool the largest one sized.
        for rows in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(rows, _AttentionSplit(self, rows, None))  # warm-up: lazy initialisation, autotuning
                torch.cuda.synchronize(self.device)
                split = _AttentionSplit(self, rows, pool)
                split.begin()
                self._forward(rows, split)
                split.segments[-1].capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graphs[rows] = _PiecewiseGraph(split.segments, split.calls)
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: Batch) -> bool:
        return batch.is_prefill and batch.input_ids is not None and batch.input_ids.numel() <= self.max_tokens

    def padded_tokens(self, n: int) -> int:
        """The captured token count a step of ``n`` (at most ``max_tokens``) tokens replays."""
        return next(s for s in self.sizes if s >= n)

    def replay(self, batch: Batch) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` of prefill ``batch`` (tensors and attention metadata prepared)."""
        assert batch.input_ids is not None and batch.positions is not None and self.hidden is not None
        n = batch.input_ids.numel()
        size = self.padded_tokens(n)
        graph = self.graphs[size]
        self.ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        stored = self.kv_pool is not None
        if stored:
            assert batch.out_loc is not None
            self.out_loc[:n].copy_(batch.out_loc)
            self.out_loc[n:size].zero_()  # the padding tokens' K/V go to scratch slot 0, not to last step's slots
        graph.segments[0].replay()
        # Every call of a size reads and writes the same static buffers: their views are made once per step.
        views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        attn = self.attn
        for call, segment in zip(graph.calls, graph.segments[1:], strict=True):
            view = views.get(id(call.out))
            if view is None:
                view = views[id(call.out)] = (call.q[:n], call.k[:n], call.v[:n], call.out[:n])
            q, k, v, out = view
            if stored:
                attn.attend_stored(q, k, v, call.layer_id, batch, out)
            else:
                out.copy_(attn.forward(q, k, v, call.layer_id, batch))
            segment.replay()
        return self.hidden[:n]
