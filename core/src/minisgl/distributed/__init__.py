"""Tensor-parallel rank information and collectives behind a small interface (world size 1: identity)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Communicator", "SingleCommunicator", "TPInfo", "TorchDistCommunicator"]


@dataclass(frozen=True)
class TPInfo:
    """Rank and world size of the tensor-parallel group (``size == 1``: no parallelism)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.size}")

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's share of ``total``; an error if it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size


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
    """Collectives on a ``torch.distributed`` process group (NCCL on CUDA, gloo on CPU); ``group=None`` is
    the default group. The group may be one this engine made itself, unknown to ``torch.distributed``."""

    def __init__(self, group: Any = None, world_size: int | None = None):
        import torch.distributed as dist

        self.group: Any = group if group is not None else dist.group.WORLD
        self.world_size = world_size or dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)
