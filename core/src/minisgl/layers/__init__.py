"""Tensor-parallel building blocks that model files are assembled from."""

from .attention import AttentionBlock, ForwardContext
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_loader,
    set_loader,
)
from .mlp import GatedMLP, activation
from .norm import RMSNorm
from .quant import (
    UNQUANTIZED,
    ExpertWeights,
    FusedInput,
    LinearInput,
    LinearOp,
    QuantizedActivation,
    QuantMethod,
    Unquantized,
    new_param,
)
from .rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "AttentionBlock",
    "ColumnParallelLinear",
    "ExpertWeights",
    "ForwardContext",
    "FusedInput",
    "GatedMLP",
    "LinearBase",
    "LinearInput",
    "LinearOp",
    "ParallelLMHead",
    "QuantMethod",
    "QKVParallelLinear",
    "QuantizedActivation",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "UNQUANTIZED",
    "Unquantized",
    "VocabParallelEmbedding",
    "activation",
    "default_loader",
    "new_param",
    "rope_parameters",
    "set_loader",
]
