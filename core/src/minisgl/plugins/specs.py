"""Declarative spec dataclasses that plugins return from their hooks.

A spec says *what* a plugin provides and *how to build it*, without building
anything. Factories may be given as a callable or as a lazy ``"pkg.mod:attr"``
string, so that a plugin's entry module never imports heavy kernel libraries:
the string is resolved only when the component is actually constructed.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import PluginError

logger = logging.getLogger(__name__)

Factory = Callable[..., Any] | str
DeviceCheck = Callable[[str], bool] | str | None

Kind = Literal["model", "attention", "kv_pool", "prefix_cache", "moe"]

KINDS: tuple[Kind, ...] = ("model", "attention", "kv_pool", "prefix_cache", "moe")

KIND_LABELS: dict[Kind, str] = {
    "model": "model architecture",
    "attention": "attention backend",
    "kv_pool": "KV cache pool",
    "prefix_cache": "prefix cache",
    "moe": "MoE backend",
}

# "pkg.mod:attr" or "pkg.mod:Class.attr"
_LAZY_REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# Names appear on command lines ("--attn fa,flashinfer"), so no commas or spaces.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
# "auto" asks the registry to choose, so no component may be called that.
RESERVED_NAMES = frozenset({"auto"})


def resolve(ref: Factory) -> Any:
    """Resolve a lazy ``"pkg.mod:attr"`` reference (or return a callable unchanged)."""
    if not isinstance(ref, str):
        return ref
    if not _LAZY_REF.match(ref):
        raise ValueError(f"lazy reference {ref!r} must look like 'package.module:attribute'")
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _check_ref(owner: str, field_name: str, value: object) -> None:
    expected = "a callable or a 'package.module:attribute' string"
    if isinstance(value, str):
        if not _LAZY_REF.match(value):
            raise ValueError(f"{owner}.{field_name} must be {expected}, got {value!r}")
    elif not callable(value):
        raise TypeError(f"{owner}.{field_name} must be {expected}, got {value!r}")


class Unsupported(Exception):
    """Raised by an ``is_supported`` check: the component cannot run on that device, and why.

    The message is shown to users as is (``--attn NAME`` fails with it), so say what
    is missing and what to do: ``"needs compute capability 10.0 or 10.3 (this GPU is
    9.0); on Hopper use --attn flashinfer"``.
    """


@dataclass(frozen=True)
class ComponentSpec:
    """Fields shared by every spec.

    ``name``
        Unique within its kind across all active plugins (a clash is a start-up
        error unless exactly one of the two specs sets ``override=True``).
    ``factory``
        A callable, or a lazy ``"package.module:attribute"`` string imported only
        when the component is built. What it is called with depends on the kind.
    ``aliases``
        Other names the component answers to (a tuple of strings).
    ``priority``
        ``auto`` picks the supported component with the highest priority (ties by name).
    ``is_supported``
        ``None`` (runs everywhere), or a callable / lazy reference taking the
        device type (``"cpu"`` or ``"cuda"``) and returning a bool. To say *why* a
        component cannot run (a GPU too old, a missing library), raise
        :class:`Unsupported` with the reason instead of returning ``False``: naming
        the component then fails with that reason, and ``minisgl plugins --device``
        shows it. It may import heavy libraries: it runs only when a component is
        picked (or listed with ``--device``).
    ``override``
        Replace a component of the same name from another plugin (with a warning).
    ``description``
        One line shown by ``minisgl plugins``.
    """

    name: str
    factory: Factory
    aliases: tuple[str, ...] = ()
    priority: int = 0
    is_supported: DeviceCheck = None
    override: bool = False
    description: str = ""

    kind: Kind = field(default="attention", init=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.aliases, tuple):
            raise TypeError(f"{owner}.aliases must be a tuple of strings, got {self.aliases!r}")
        for n in (self.name, *self.aliases):
            if not isinstance(n, str) or not _NAME.match(n):
                raise ValueError(
                    f"{owner} name or alias {n!r} is invalid: use letters, digits and '_ . + -' (no commas or spaces)"
                )
            if n in RESERVED_NAMES:
                raise ValueError(f"{owner} name or alias {n!r} is reserved (it asks minisgl to choose)")
        if self.name in self.aliases:
            raise ValueError(f"{owner} '{self.name}' lists its own name among its aliases")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"{owner}.priority must be an int, got {self.priority!r}")
        _check_ref(owner, "factory", self.factory)
        if self.is_supported is not None:
            _check_ref(owner, "is_supported", self.is_supported)

    @property
    def label(self) -> str:
        """``attention backend 'torch'``: how messages name this component."""
        return f"{KIND_LABELS[self.kind]} '{self.name}'"

    @property
    def factory_ref(self) -> str:
        """The factory as text, for listings and messages."""
        if isinstance(self.factory, str):
            return self.factory
        return f"{getattr(self.factory, '__module__', '?')}:{getattr(self.factory, '__qualname__', repr(self.factory))}"

    def load_factory(self) -> Callable[..., Any]:
        """Import the factory (a lazy reference is imported now); :class:`PluginError` if it cannot be."""
        try:
            return resolve(self.factory)  # type: ignore[no-any-return]
        except Exception as exc:
            raise PluginError(
                f"cannot load the factory {self.factory_ref!r} of {self.label}: {type(exc).__name__}: {exc}"
            ) from exc

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Import the factory and call it with the arguments its kind prescribes."""
        return self.load_factory()(*args, **kwargs)

    def supports(self, device: str) -> bool:
        """Whether this component can run on ``device`` (a device type, ``"cpu"`` or ``"cuda"``)."""
        return self.unsupported_reason(device) is None

    def unsupported_reason(self, device: str) -> str | None:
        """``None`` when this component runs on ``device``; otherwise why not.

        The reason is the message of the :class:`Unsupported` the check raised, or
        ``""`` when it just returned ``False``.
        """
        if self.is_supported is None:
            return None
        device_type = device.split(":", 1)[0]
        try:
            ok = resolve(self.is_supported)(device_type)
        except Unsupported as exc:
            return str(exc)
        except Exception as exc:  # a broken check means "not supported", never a crash at start-up
            logger.warning(
                "is_supported check of %s failed (%s: %s); treating it as unsupported",
                self.label,
                type(exc).__name__,
                exc,
            )
            return f"its is_supported check failed ({type(exc).__name__}: {exc})"
        return None if ok else ""


@dataclass(frozen=True)
class ModelSpec(ComponentSpec):
    """A model architecture. ``name`` is the Hugging Face architecture string,
    e.g. ``"LlamaForCausalLM"``; the factory is the model class, called as
    ``factory(ctx: minisgl.models.ModelContext)`` and returning a ``CausalLM``."""

    kind: Kind = field(default="model", init=False)


@dataclass(frozen=True)
class AttentionBackendSpec(ComponentSpec):
    """An attention backend, built as ``factory(ctx: minisgl.attention.AttentionContext)``
    and returning a ``BaseAttnBackend``. ``--attn auto`` picks the supported backend
    with the highest ``priority``."""

    kind: Kind = field(default="attention", init=False)


@dataclass(frozen=True)
class KVPoolSpec(ComponentSpec):
    """A KV cache pool, built as ``factory(layout: minisgl.kvcache.KVLayout)`` and
    returning a ``BaseKVPool``."""

    kind: Kind = field(default="kv_pool", init=False)


@dataclass(frozen=True)
class PrefixCacheSpec(ComponentSpec):
    """A prefix cache, built as ``factory(page_size=int, device=torch.device)`` and
    returning a ``BasePrefixCache``. The default cache is the supported one with the
    highest ``priority``."""

    kind: Kind = field(default="prefix_cache", init=False)


@dataclass(frozen=True)
class MoEBackendSpec(ComponentSpec):
    """A mixture-of-experts compute backend, built as ``factory()`` and returning a
    ``BaseMoEBackend``. ``--moe-backend auto`` picks the supported backend with the
    highest ``priority``."""

    kind: Kind = field(default="moe", init=False)


ALL_SPEC_TYPES: dict[Kind, type[ComponentSpec]] = {
    "model": ModelSpec,
    "attention": AttentionBackendSpec,
    "kv_pool": KVPoolSpec,
    "prefix_cache": PrefixCacheSpec,
    "moe": MoEBackendSpec,
}
