"""The mixture-of-experts backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertScales:
    """The scales of quantized expert weights (``real = weight * scale``, float32): ``w13`` ``[experts, 2 * inter,
    k_blocks]`` and ``w2`` ``[experts, hidden, k_blocks]``, one scale per weight row and ``block_k`` input columns
    (the last block partial), or per row (``block_k`` None: ``k_blocks`` is 1)."""

    w13: torch.Tensor
    w2: torch.Tensor
    block_k: int | None = None


class BaseMoEBackend(ABC):
    """Computes the routed expert MLPs of one MoE layer: ``w13`` ``[experts, 2 * inter, hidden]`` (gate rows,
    then up rows), ``w2`` ``[experts, hidden, inter]``, ``inter`` being this rank's share."""

    supports_cuda_graph: bool = False  # True: forward never syncs with the host and sizes follow the inputs
    #: Quantized weight dtypes ``forward`` runs, given their ``scales`` (e.g. ``(torch.float8_e4m3fn,)``). A
    #: quantization method de-quantizes the experts once after loading for a backend that does not list its dtype.
    expert_dtypes: tuple[torch.dtype, ...] = ()

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
        ``topk_ids[t, k]`` (``[tokens, k]`` both); partial sums under tensor parallelism. A backend that lists
        ``expert_dtypes`` also takes ``scales=`` (:class:`ExpertScales`), passed only when the weights are
        quantized: ``w13`` and ``w2`` are then in one of those dtypes."""


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: top-k expert weights (float32) and ids (int64) per token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
