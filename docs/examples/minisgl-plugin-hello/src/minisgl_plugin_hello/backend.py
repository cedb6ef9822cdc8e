"""The backend itself. Imported only when an engine builds the 'hello' backend."""

from __future__ import annotations

import logging

import torch

from minisgl.attention import AttentionContext, TorchAttnBackend
from minisgl.core import Batch

logger = logging.getLogger(__name__)


class HelloAttnBackend(TorchAttnBackend):
    """The torch reference backend, plus a count of the new tokens it has attended (all layers)."""

    def __init__(self, ctx: AttentionContext):
        super().__init__(ctx)
        self.tokens_attended = 0
        logger.info(
            "hello from the 'hello' attention backend (%d query heads, %d KV heads, head dim %d)",
            ctx.num_qo_heads,
            ctx.num_kv_heads,
            ctx.head_dim,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        self.tokens_attended += q.shape[0]
        return super().forward(q, k, v, layer_id, batch)
