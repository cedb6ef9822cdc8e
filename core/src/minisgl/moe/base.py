"""The mixture-of-experts backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseMoEBackend(ABC):
    """Computes the routed expert MLPs of one MoE layer: ``w13`` ``[experts, 2 * inter, hidden]`` (gate rows,
    then up rows), ``w2`` ``[experts, hidden, inter]``, ``inter`` being this rank's share."""

    supports_cuda_graph: bool = False  # True: forward never syncs with the host and sizes follow the inputs

    @abstractmethod
    def forward(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``[tokens, hidden]``: ``sum_k topk_weights[t, k] * down(silu(gate(x_t)) * up(x_t))`` for expert
        ``topk_ids[t, k]`` (``[tokens, k]`` both); partial sums under tensor parallelism."""


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: top-k expert weights (float32) and ids (int64) per token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
