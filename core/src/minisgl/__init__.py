"""minisgl: a compact, fast LLM inference and serving engine with a plugin core.

``from minisgl import LLM, SamplingParams`` is the offline API. Heavy modules
(torch, transformers) are imported on first use, so that ``minisgl.plugins``
and the command line stay fast to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .utils import VERSION as __version__

if TYPE_CHECKING:
    from .core import SamplingParams
    from .llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
_LAZY = {"LLM": ".llm", "RequestOutput": ".llm", "SamplingParams": ".core"}  # the module each comes from


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
