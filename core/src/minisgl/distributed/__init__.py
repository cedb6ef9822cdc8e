"""Tensor-parallel rank information and the communicator interface."""

from .comm import Communicator, SingleCommunicator, TorchDistCommunicator
from .info import TPInfo

__all__ = ["Communicator", "SingleCommunicator", "TPInfo", "TorchDistCommunicator"]
