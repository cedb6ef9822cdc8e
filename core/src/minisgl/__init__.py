"""minisgl: a compact, fast LLM inference and serving engine with a plugin core.

``from minisgl import LLM, SamplingParams`` is the offline API. Heavy modules
(torch, transformers) are imported on first use, so that ``minisgl.plugins``
and the command line stay fast to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .utils import VERSION as __version__

if TYPE_CHECKING:
    from .core import SamplingParams
    from .llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from .core import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
