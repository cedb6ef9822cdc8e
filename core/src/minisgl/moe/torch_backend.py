"""Reference MoE backend: tokens sorted by expert, one matmul pair per active expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BaseMoEBackend


class TorchMoEBackend(BaseMoEBackend):
    def forward(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
        token_of = order // k
        out = torch.zeros_like(hidden, dtype=torch.float32)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start : start + n]
            picks = order[start : start + n]
            start += n
            x = hidden[rows]
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert])
            weight = topk_weights.reshape(-1)[picks].unsqueeze(-1)
            out.index_add_(0, rows, y.float() * weight)
        return out.to(hidden.dtype)
