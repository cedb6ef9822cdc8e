"""Attention backends: the interface, the ``torch`` reference (torch_backend) and ``cpu`` (cpu_backend)."""

from .base import AttentionContext, BaseAttnBackend, HybridAttnBackend
from .torch_backend import TorchAttnBackend

__all__ = ["AttentionContext", "BaseAttnBackend", "HybridAttnBackend", "TorchAttnBackend"]
