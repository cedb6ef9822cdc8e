"""CUDA-graph capture and replay of decode steps: a small model's decode step is hundreds of short kernels,
cheaper to replay than to launch from Python. Each size of :func:`graph_batch_sizes` gets one graph (forward
and LM head) over static inputs; a batch replays the smallest graph that fits, padded with dummy entries
that write to scratch slot 0. The graphs share one memory pool: they never run at once."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ..core import Batch
from ..layers import ForwardContext

if TYPE_CHECKING:
    from ..attention import BaseAttnBackend
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
