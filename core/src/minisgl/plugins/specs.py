"""What plugins return from their hooks (frozen spec dataclasses), and the plugin layer's errors. A factory or
support check may be a lazy ``"pkg.mod:attr"`` string, imported only when used: entry modules import no kernels."""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

logger = logging.getLogger(__name__)

Kind = Literal["model", "attention", "kv_pool", "prefix_cache", "moe", "kernels", "grammar", "quantization"]
_LAZY_REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")  # "pkg.mod:Cls.attr"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")  # names appear in "--attn fa,flashinfer"


class PluginError(RuntimeError):
    """A plugin could not be loaded, two plugins conflict, or a component cannot be built."""


class UnknownComponentError(LookupError):
    """A requested component is not provided by any active plugin (or not for this device)."""

    def __str__(self) -> str:  # LookupError would quote the message like a key
        return str(self.args[0]) if self.args else ""


class PluginWarning(UserWarning):
    """A plugin was skipped, overridden or misconfigured; start-up goes on without it."""


class Unsupported(Exception):
    """Raised by an ``is_supported`` check (or a kernel set's factory): the component cannot run there;
    the message says why and what to do (``"needs compute capability 10.0; use --attn flashinfer"``)."""


def resolve(ref: Callable[..., Any] | str) -> Any:
    """Import a lazy ``"pkg.mod:attr"`` reference (a callable is returned unchanged)."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class ComponentSpec:
    """One component; docs/plugins.md, "Reference: spec fields", describes each field. ``is_supported``
    takes the device type and returns a bool or raises :class:`Unsupported`."""

    kind: ClassVar[Kind]
    noun: ClassVar[str]  # how messages name the kind
    hook: ClassVar[str]  # the hook that declares the kind
    name: str
    factory: Callable[..., Any] | str
    aliases: tuple[str, ...] = ()
    auto: bool = False  # a candidate for ``auto`` (``--attn auto``, ...); otherwise chosen only by name
    priority: int = 0  # among auto candidates, overrides the order set by pluggy's hook order; rarely needed
    is_supported: Callable[[str], bool] | str | None = None
    override: bool = False  # replaces another plugin's component of the same name
    description: str = ""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.aliases, tuple):
            raise TypeError(f"{owner}.aliases must be a tuple of strings, got {self.aliases!r}")
        if bad := [n for n in (self.name, *self.aliases) if not isinstance(n, str) or not _NAME.match(n)]:
            raise ValueError(
                f"{owner} name or alias {bad[0]!r} is invalid: use letters, digits and '_ . + -' (no commas or spaces)"
            )
        if "auto" in (self.name, *self.aliases):
            raise ValueError(f"{owner} name or alias 'auto' is reserved (it asks minisgl to choose)")
        if self.name in self.aliases:
            raise ValueError(f"{owner} '{self.name}' lists its own name among its aliases")
        if not isinstance(self.auto, bool):
            raise TypeError(f"{owner}.auto must be True or False, got {self.auto!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"{owner}.priority must be an int, got {self.priority!r}")
        for attr in ("factory", "is_supported") if self.is_supported is not None else ("factory",):
            ref = getattr(self, attr)
            if not (_LAZY_REF.match(ref) if isinstance(ref, str) else callable(ref)):
                error = ValueError if isinstance(ref, str) else TypeError
                raise error(f"{owner}.{attr} must be a callable or a 'package.module:attribute' string, got {ref!r}")

    @property
    def label(self) -> str:
        """``attention backend 'torch'``: how messages name this component."""
        return f"{self.noun} '{self.name}'"

    @property
    def factory_ref(self) -> str:
        if isinstance(self.factory, str):
            return self.factory
        return f"{getattr(self.factory, '__module__', '?')}:{getattr(self.factory, '__qualname__', self.factory)}"

    def load_factory(self) -> Callable[..., Any]:
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
        return self.unsupported_reason(device) is None

    def unsupported_reason(self, device: str) -> str | None:
        """``None`` when this runs on ``device`` (``"cuda:1"`` counts as ``"cuda"``), else why not
        (``""`` when the check just returned False). A check that crashes means unsupported."""
        if self.is_supported is None:
            return None
        try:
            return None if resolve(self.is_supported)(device.split(":", 1)[0]) else ""
        except Unsupported as exc:
            return str(exc)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            logger.warning("is_supported check of %s failed (%s); treating it as unsupported", self.label, why)
            return f"its is_supported check failed ({why})"


class ModelSpec(ComponentSpec):
    """``name``: the Hugging Face architecture; built as ``factory(ctx: ModelContext)`` -> ``CausalLM``."""

    kind, noun, hook = "model", "model architecture", "minisgl_models"


@dataclass(frozen=True)
class AttentionBackendSpec(ComponentSpec):
    """Built as ``factory(ctx: AttentionContext)`` -> ``BaseAttnBackend`` (``--attn NAME``). Every backend reads
    a KV cache in the model dtype; ``kv_cache_dtypes`` names the quantized ones it reads too (``"fp8_e4m3"``:
    the pool's float8 values times the layer's ``KVLayout.kv_scales``), so a ``--kv-cache-dtype`` it does not
    read is refused at start-up. ``decode_kv_cache_dtypes``: those of them over which ``--attn auto`` should
    decode with it even where another backend ranks first (that one then prefills)."""

    kind, noun, hook = "attention", "attention backend", "minisgl_attention_backends"
    kv_cache_dtypes: tuple[str, ...] = ()
    # KV cache dtypes (of kv_cache_dtypes) this backend decodes faster than the backends ranked above it: under
    # ``--attn auto`` the best-ranked backend prefills and the best-ranked one listing the dtype here decodes.
    decode_kv_cache_dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        for attr in ("kv_cache_dtypes", "decode_kv_cache_dtypes"):
            value = getattr(self, attr)
            if not isinstance(value, tuple) or not all(isinstance(n, str) for n in value):
                raise TypeError(f"AttentionBackendSpec.{attr} must be a tuple of strings, got {value!r}")
        if unread := [n for n in self.decode_kv_cache_dtypes if n not in self.kv_cache_dtypes]:
            raise ValueError(
                f"{self.label}: decode_kv_cache_dtypes names {', '.join(unread)}, which kv_cache_dtypes does not "
                "(a backend decodes only a cache it reads)"
            )

    def reads_kv_cache(self, kv_cache_dtype: str) -> bool:
        """Whether this backend reads a KV cache of ``kv_cache_dtype`` (``auto``: the model dtype)."""
        return kv_cache_dtype == "auto" or kv_cache_dtype in self.kv_cache_dtypes


class KVPoolSpec(ComponentSpec):
    """Built as ``factory(layout: KVLayout)`` -> ``BaseKVPool`` (``--kv-pool NAME``)."""

    kind, noun, hook = "kv_pool", "KV cache pool", "minisgl_kv_cache_pools"


class PrefixCacheSpec(ComponentSpec):
    """Built as ``factory(page_size=int, device=torch.device)`` -> ``BasePrefixCache`` (``--cache NAME``)."""

    kind, noun, hook = "prefix_cache", "prefix cache", "minisgl_prefix_caches"


class MoEBackendSpec(ComponentSpec):
    """Built as ``factory()`` -> ``BaseMoEBackend`` (``--moe-backend NAME``)."""

    kind, noun, hook = "moe", "MoE backend", "minisgl_moe_backends"


class KernelSetSpec(ComponentSpec):
    """Built as ``factory(device: torch.device, dtype: torch.dtype)`` -> ``KernelSet`` (``--kernels NAME``);
    the factory raises :class:`Unsupported` for a dtype it does not serve (``auto`` then takes the next)."""

    kind, noun, hook = "kernels", "kernel set", "minisgl_kernel_sets"


class GrammarBackendSpec(ComponentSpec):
    """Built as ``factory(tokenizer, vocab_size: int, device: torch.device, *, stop_token_ids: Sequence[int],
    max_rows: int)`` -> ``BaseGrammarBackend`` (``--grammar-backend NAME``), one per scheduler."""

    kind, noun, hook = "grammar", "grammar backend", "minisgl_grammar_backends"


@dataclass(frozen=True)
class QuantizationSpec(ComponentSpec):
    """Built as ``factory(config: dict | None, dtype: torch.dtype, device: torch.device)`` -> ``QuantMethod``
    (``--quantization NAME``): ``config`` is the checkpoint's ``quantization_config`` (None for a checkpoint
    that is not quantized: quantize at load, or raise ``ValueError``); the factory raises ``ValueError`` naming
    any setting it does not support. ``quant_methods``: the ``quantization_config.quant_method`` values it
    reads (how ``auto`` finds it); ``devices`` and ``dtypes``: where it runs (activation dtypes), shown by
    ``minisgl plugins``; ``is_supported`` may say more (a GPU generation). ``check_config``, optional:
    ``check_config(config, model_config) -> None`` (``model_config``: the checkpoint's config.json as a dict),
    a check without torch that the server runs before any worker starts; it raises ``ValueError`` naming what
    the method cannot load (a setting, a model kind), as the factory would later."""

    kind, noun, hook = "quantization", "quantization method", "minisgl_quantization_methods"
    quant_methods: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    check_config: Callable[[dict[str, Any] | None, dict[str, Any]], None] | str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for attr in ("quant_methods", "devices", "dtypes"):
            value = getattr(self, attr)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"QuantizationSpec.{attr} must be a tuple of strings, got {value!r}")
        ref = self.check_config
        if ref is not None and not (_LAZY_REF.match(ref) if isinstance(ref, str) else callable(ref)):
            raise TypeError(
                f"QuantizationSpec.check_config must be a callable or a 'package.module:attribute' string, got {ref!r}"
            )

    def check(self, config: dict[str, Any] | None, model_config: dict[str, Any]) -> None:
        """Run ``check_config`` (nothing without one): ``ValueError`` for what the method cannot load."""
        if self.check_config is not None:
            resolve(self.check_config)(config, model_config)

    def unsupported_reason(self, device: str) -> str | None:
        if device.split(":", 1)[0] not in self.devices:
            return f"runs on {', '.join(self.devices) or 'no device'}"
        return super().unsupported_reason(device)


SPEC_TYPES: dict[Kind, type[ComponentSpec]] = {t.kind: t for t in ComponentSpec.__subclasses__()}
KINDS: tuple[Kind, ...] = tuple(SPEC_TYPES)
