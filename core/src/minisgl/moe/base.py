"""The mixture-of-experts backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseMoEBackend(ABC):
    """Computes the routed expert MLPs of one MoE layer.

    Weights are laid out per expert so tensor parallelism can split each expert
    by columns/rows: ``w13`` is ``[experts, 2 * inter, hidden]`` (gate rows then
    up rows) and ``w2`` is ``[experts, hidden, inter]``, where ``inter`` is this
    rank's share of the expert intermediate size.

    ``supports_cuda_graph`` says whether :meth:`forward` can be captured in a
    CUDA graph (no host synchronisation, sizes fixed by the input shapes).
    """

    supports_cuda_graph: bool = False

    @abstractmethod
    def forward(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * down(silu(gate(x_t)) * up(x_t))`` for expert ``topk_ids[t, k]``.

        ``hidden``: ``[tokens, hidden]``; ``topk_weights``/``topk_ids``: ``[tokens, k]``.
        Returns ``[tokens, hidden]`` (partial sums under tensor parallelism).
        """


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: top-k expert weights (float32) and ids (int64) per token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
