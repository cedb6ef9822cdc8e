"""Attention backends: the interface and the built-in ``torch`` reference."""

from .base import AttentionContext, BaseAttnBackend, HybridAttnBackend

__all__ = ["AttentionContext", "BaseAttnBackend", "HybridAttnBackend"]
