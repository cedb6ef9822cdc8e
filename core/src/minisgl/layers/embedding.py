"""Vocabulary-parallel embedding and LM head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet, select_kernels
from .linear import set_loader


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (vocabulary padded to a multiple of the rank count)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TPInfo = TPInfo(),
        comm: Communicator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        kernels: KernelSet | None = None,
    ):
        super().__init__()
        self.tp, self.comm = tp, comm or SingleCommunicator()
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        weight = torch.zeros(self.local_vocab, hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        set_loader(self.weight, self.load_weight)
        self.kernels = kernels or select_kernels(device, self.weight.dtype)  # the LM head's GEMM

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        part = loaded[self.vocab_start : self.vocab_start + self.local_vocab]  # the last rank's may be short
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        valid = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * valid.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its slice of the logits."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.kernels.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
