"""Attention backends: the interface and the ``torch`` reference."""

from .base import AttentionContext, BaseAttnBackend, HybridAttnBackend
from .torch_backend import TorchAttnBackend

__all__ = ["AttentionContext", "BaseAttnBackend", "HybridAttnBackend", "TorchAttnBackend"]
