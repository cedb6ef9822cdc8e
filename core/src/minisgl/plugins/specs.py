"""Declarative spec dataclasses that plugins return from their hooks.

A spec says *what* a plugin provides and *how to build it*, without building
anything. Factories may be given as a callable or as a lazy ``"pkg.mod:attr"``
string, so that a plugin's entry module never imports heavy kernel libraries:
the string is resolved only when the component is actually constructed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Factory = Callable[..., Any] | str
DeviceCheck = Callable[[str], bool] | str | None

Kind = Literal["model", "attention", "kv_pool", "prefix_cache", "moe"]


def resolve(ref: Factory) -> Any:
    """Resolve a lazy ``"pkg.mod:attr"`` reference (or return a callable unchanged)."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"lazy reference {ref!r} must look like 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class ComponentSpec:
    """Fields shared by every spec: a unique name within its kind and a factory."""

    name: str
    factory: Factory
    aliases: tuple[str, ...] = ()
    priority: int = 0
    is_supported: DeviceCheck = None
    override: bool = False
    description: str = ""

    kind: Kind = field(default="attention", init=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"{type(self).__name__}.name must be a non-empty string")
        if not isinstance(self.aliases, tuple):
            raise TypeError(f"{type(self).__name__}.aliases must be a tuple of strings")

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Resolve the factory and call it."""
        return resolve(self.factory)(*args, **kwargs)

    def supports(self, device: str) -> bool:
        """Whether this component can run on ``device`` ("cpu" or "cuda")."""
        if self.is_supported is None:
            return True
        check = resolve(self.is_supported)
        try:
            return bool(check(device))
        except Exception:  # a broken check means "not supported", never a crash at start-up
            return False


@dataclass(frozen=True)
class ModelSpec(ComponentSpec):
    """A model architecture. ``name`` is the Hugging Face architecture string,
    e.g. ``"LlamaForCausalLM"``; the factory is the model class, called as
    ``factory(ctx: minisgl.models.ModelContext)``."""

    kind: Kind = field(default="model", init=False)


@dataclass(frozen=True)
class AttentionBackendSpec(ComponentSpec):
    """An attention backend, built as ``factory(ctx: minisgl.attention.AttentionContext)``.
    ``--attn auto`` picks the supported backend with the highest ``priority``."""

    kind: Kind = field(default="attention", init=False)


@dataclass(frozen=True)
class KVPoolSpec(ComponentSpec):
    """A KV cache pool, built as ``factory(layout: minisgl.kvcache.KVLayout)``."""

    kind: Kind = field(default="kv_pool", init=False)


@dataclass(frozen=True)
class PrefixCacheSpec(ComponentSpec):
    """A prefix cache, built as ``factory(page_size: int, device: torch.device)``.
    The default cache is the supported one with the highest ``priority``."""

    kind: Kind = field(default="prefix_cache", init=False)


@dataclass(frozen=True)
class MoEBackendSpec(ComponentSpec):
    """A mixture-of-experts compute backend, built as ``factory()``.
    ``--moe-backend auto`` picks the supported backend with the highest ``priority``."""

    kind: Kind = field(default="moe", init=False)


ALL_SPEC_TYPES: dict[Kind, type[ComponentSpec]] = {
    "model": ModelSpec,
    "attention": AttentionBackendSpec,
    "kv_pool": KVPoolSpec,
    "prefix_cache": PrefixCacheSpec,
    "moe": MoEBackendSpec,
}
