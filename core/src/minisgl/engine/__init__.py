"""The engine: model, KV memory and attention on one device."""

from .engine import Engine, StepResult
from .sampling import Sampler

__all__ = ["Engine", "Sampler", "StepResult"]
