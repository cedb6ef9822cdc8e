"""What a forward pass needs besides token ids and positions: passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import Batch

if TYPE_CHECKING:  # the backend is built above this floor; layers only call it
    from ..attention import BaseAttnBackend


@dataclass
class ForwardContext:
    """The batch being run and the attention backend to run it with."""

    batch: Batch
    attn: BaseAttnBackend
