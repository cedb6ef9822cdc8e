"""What a forward pass needs besides token ids and positions: passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from ..attention import BaseAttnBackend
from ..core import Batch


@dataclass
class ForwardContext:
    """The batch being run and the attention backend to run it with."""

    batch: Batch
    attn: BaseAttnBackend
