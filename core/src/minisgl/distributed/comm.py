"""Collective communication behind a small interface (world size 1: identity)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Communicator(ABC):
    """All-reduce and all-gather across the tensor-parallel group."""

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks (may be in place); return the result."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""


class SingleCommunicator(Communicator):
    """The communicator of a one-rank group."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


class TorchDistCommunicator(Communicator):
    """``torch.distributed`` collectives (NCCL on CUDA, gloo on CPU)."""

    def __init__(self, group: Any = None, world_size: int | None = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.world_size = world_size or dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
