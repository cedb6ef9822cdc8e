"""Continuous batching over an engine."""

from .scheduler import Scheduler, TokenEvent

__all__ = ["Scheduler", "TokenEvent"]
