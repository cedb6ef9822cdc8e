"""Which tensor-parallel rank this process is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPInfo:
    """Rank and world size of the tensor-parallel group (``size == 1``: no parallelism)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.size}")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's share of ``total``; an error if it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size
