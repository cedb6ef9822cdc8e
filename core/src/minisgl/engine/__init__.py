"""The engine: model, KV memory and attention on one device."""

from .engine import Engine, PendingStep, StepInputs, StepResult
from .graph import CudaGraphRunner
from .sampling import Sampler

__all__ = ["CudaGraphRunner", "Engine", "PendingStep", "Sampler", "StepInputs", "StepResult"]
