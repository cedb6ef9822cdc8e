"""Mixture-of-experts: the backend interface, routing and the ``torch`` reference."""

from .base import BaseMoEBackend, route

__all__ = ["BaseMoEBackend", "route"]
