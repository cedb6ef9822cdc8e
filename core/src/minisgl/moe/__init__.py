"""Mixture-of-experts: the backend interface, routing, the sparse MoE block and the ``torch`` reference."""

from .base import BaseMoEBackend, ExpertScales, route
from .layer import MoEExperts, SparseMoEBlock, expert_weight_target
from .torch_backend import TorchMoEBackend

__all__ = [
    "BaseMoEBackend",
    "ExpertScales",
    "MoEExperts",
    "SparseMoEBlock",
    "TorchMoEBackend",
    "expert_weight_target",
    "route",
]
