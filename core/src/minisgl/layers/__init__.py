"""Tensor-parallel building blocks that model files are assembled from."""

from .attention import AttentionBlock, ForwardContext
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_loader,
    set_loader,
)
from .mlp import GatedMLP, activation
from .norm import RMSNorm
from .rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "AttentionBlock",
    "ColumnParallelLinear",
    "ForwardContext",
    "GatedMLP",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "activation",
    "default_loader",
    "rope_parameters",
    "set_loader",
]
