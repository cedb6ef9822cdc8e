"""The registries built from the active plugins, and how name clashes are settled.

A :class:`PluginRegistry` is plain data: for each component kind, a dictionary
from names to specs (with the plugin that provided each). It is built once at
start-up by :func:`minisgl.plugins.load_plugins`; engines read it, nothing on the
per-step path touches pluggy.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import PluginWarning, UnknownComponentError
from .specs import KIND_LABELS, KINDS, ComponentSpec, Kind

Status = Literal["active", "disabled", "failed", "incompatible"]

# Components published by the project's own plugin packages, so that a name that is
# known but not installed gets an actionable "pip install ..." hint.
KNOWN_PROVIDERS: dict[Kind, dict[str, str]] = {
    "model": {
        "LlamaForCausalLM": "minisgl-plugin-llama",
        "MistralForCausalLM": "minisgl-plugin-llama",
        "Qwen2ForCausalLM": "minisgl-plugin-llama",
        "Qwen3ForCausalLM": "minisgl-plugin-llama",
        "Qwen3MoeForCausalLM": "minisgl-plugin-qwen3-moe",
    },
    "attention": {
        "flashinfer": "minisgl-plugin-flashinfer",
        "fi": "minisgl-plugin-flashinfer",
        "fa": "minisgl-plugin-fa",
        "flash-attn": "minisgl-plugin-fa",
        "fa2": "minisgl-plugin-fa",
        "fa3": "minisgl-plugin-fa",
        "fa4": "minisgl-plugin-fa",
        "trtllm": "minisgl-plugin-trtllm",
        "trtllm-xqa": "minisgl-plugin-trtllm",
        "xqa": "minisgl-plugin-trtllm",
    },
    "kv_pool": {},
    "prefix_cache": {"radix": "minisgl-plugin-radix"},
    "moe": {"fused": "minisgl-plugin-qwen3-moe", "triton": "minisgl-plugin-qwen3-moe"},
}


@dataclass
class PluginInfo:
    """One entry point of the ``minisgl`` group and what became of it.

    ``provides`` lists, per kind, the names this plugin contributes to the
    registry; ``overridden`` the names it declared but another plugin's
    ``override=True`` spec replaced.
    """

    name: str
    distribution: str
    version: str
    module: str
    status: Status
    error: str = ""
    provides: dict[str, list[str]] = field(default_factory=dict)
    overridden: dict[str, list[str]] = field(default_factory=dict)

    @property
    def who(self) -> str:
        """``plugin 'fa' (minisgl-plugin-fa 0.1.0)``: how messages name this plugin."""
        if not self.distribution:
            return f"plugin '{self.name}'"
        dist = f"{self.distribution} {self.version}".strip()
        return f"plugin '{self.name}' ({dist})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "status": self.status,
            "error": self.error,
            "provides": {k: list(v) for k, v in self.provides.items()},
            "overridden": {k: list(v) for k, v in self.overridden.items()},
        }


@dataclass(frozen=True)
class Provided:
    """A spec in a registry and the plugin it came from."""

    spec: ComponentSpec
    plugin: PluginInfo


class PluginRegistry:
    """Registries of every component kind, resolved once from the active plugins.

    ``plugins`` lists every plugin that was found (active or not), in load order;
    ``conflicts`` the clash messages that were tolerated (only when loaded with
    ``raise_conflicts=False``, as ``minisgl plugins`` does to show them).
    """

    def __init__(
        self,
        plugins: list[PluginInfo],
        components: dict[Kind, dict[str, Provided]],
        conflicts: list[str] | None = None,
    ):
        self.plugins = plugins
        self.conflicts = list(conflicts or [])
        self._components: dict[Kind, dict[str, Provided]] = {k: dict(components.get(k, {})) for k in KINDS}
        self._aliases: dict[Kind, dict[str, str]] = {k: {} for k in KINDS}
        for kind, entries in self._components.items():
            for name, provided in entries.items():
                for alias in provided.spec.aliases:
                    self._aliases[kind][alias] = name

    # ------------------------------------------------------------- queries
    def active_plugin_names(self) -> list[str]:
        """Entry names of the active plugins: what a parent hands to its worker processes."""
        return [p.name for p in self.plugins if p.status == "active"]

    def names(self, kind: Kind) -> list[str]:
        """Canonical names of every ``kind`` component, sorted."""
        return sorted(self._components[kind])

    def has(self, kind: Kind, name: str) -> bool:
        return name in self._components[kind] or name in self._aliases[kind]

    def specs(self, kind: Kind) -> list[ComponentSpec]:
        """Every ``kind`` spec, sorted by name."""
        return [self._components[kind][n].spec for n in self.names(kind)]

    def get(self, kind: Kind, name: str) -> ComponentSpec:
        """The spec registered for ``name`` (or an alias); :class:`UnknownComponentError` otherwise."""
        canonical = self._aliases[kind].get(name, name)
        provided = self._components[kind].get(canonical)
        if provided is not None:
            return provided.spec
        raise UnknownComponentError(self._unknown_message(kind, name))

    def provider(self, kind: Kind, name: str) -> PluginInfo:
        """The plugin that provides ``name`` (or an alias)."""
        self.get(kind, name)  # the same error as get() for an unknown name
        return self._components[kind][self._aliases[kind].get(name, name)].plugin

    def supported(self, kind: Kind, device: str) -> list[str]:
        """Names of the ``kind`` components that run on ``device``."""
        return sorted(n for n, p in self._components[kind].items() if p.spec.supports(device))

    def pick(self, kind: Kind, name: str, device: str) -> ComponentSpec:
        """Resolve ``name`` for ``device``; ``"auto"`` picks the supported spec with the highest priority."""
        if name != "auto":
            spec = self.get(kind, name)
            reason = spec.unsupported_reason(device)
            if reason is not None:
                why = f" ({reason})" if reason else ""
                raise UnknownComponentError(
                    f"{spec.label} does not support device '{device}'{why}; "
                    f"{KIND_LABELS[kind]}s that do: {', '.join(self.supported(kind, device)) or 'none'}"
                )
            return spec
        return self.ranked(kind, device)[0]

    def ranked(self, kind: Kind, device: str) -> list[ComponentSpec]:
        """The ``kind`` specs that run on ``device``, best first (what ``"auto"`` chooses from)."""
        candidates = [p.spec for p in self._components[kind].values() if p.spec.supports(device)]
        if not candidates:
            raise UnknownComponentError(
                f"no installed {KIND_LABELS[kind]} supports device '{device}'; installed: {self._installed_text(kind)}"
            )
        return sorted(candidates, key=lambda s: (s.priority, s.name), reverse=True)

    # ------------------------------------------------------------- messages
    def _installed_text(self, kind: Kind) -> str:
        parts = [
            f"{n} ({self._components[kind][n].plugin.distribution or self._components[kind][n].plugin.name})"
            for n in self.names(kind)
        ]
        return ", ".join(parts) or "none"

    def _unknown_message(self, kind: Kind, name: str) -> str:
        sentences = [f"unknown {KIND_LABELS[kind]} '{name}'; installed: {self._installed_text(kind)}"]
        package = KNOWN_PROVIDERS.get(kind, {}).get(name)
        if package is None:
            close = difflib.get_close_matches(name, [*self._components[kind], *self._aliases[kind]], n=1)
            if close:
                sentences.append(f"Did you mean '{close[0]}'?")
            inactive = [p for p in self.plugins if p.status != "active"]
            if inactive:
                listed = ", ".join(f"{p.name} ({p.status})" for p in inactive)
                sentences.append(f"Installed plugins that are not active: {listed}")
        else:
            installed = [p for p in self.plugins if _normalize(p.distribution) == _normalize(package)]
            if installed:
                p = installed[0]
                text = f"'{name}' is provided by {package}, which is installed but {p.status}"
                text += f" ({p.error})" if p.error else ""
                if p.status == "disabled":
                    text += "; check MINISGL_PLUGINS / MINISGL_DISABLE_PLUGINS"
                sentences.append(text)
            else:
                sentences.append(f"'{name}' is provided by {package}: pip install {package}")
        msg = sentences[0]
        for sentence in sentences[1:]:
            msg += (" " if msg.endswith("?") else ". ") + sentence
        return msg


def _normalize(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-").replace(".", "-")


class RegistryBuilder:
    """Adds specs kind by kind and settles clashes between plugins.

    The same name (or alias) from two plugins is a conflict, unless exactly one
    of the two specs sets ``override=True``: that one wins with a warning.
    Conflicts are collected, not raised, so that all of them can be reported at once.
    """

    def __init__(self) -> None:
        self.components: dict[Kind, dict[str, Provided]] = {k: {} for k in KINDS}
        self.conflicts: list[str] = []

    def _owners(self, kind: Kind, names: tuple[str, ...]) -> list[Provided]:
        table = self.components[kind]
        found: list[Provided] = []
        for provided in table.values():
            if set(names) & {provided.spec.name, *provided.spec.aliases} and provided not in found:
                found.append(provided)
        return found

    def add(self, spec: ComponentSpec, info: PluginInfo) -> None:
        kind = spec.kind
        names = (spec.name, *spec.aliases)
        for clash in self._owners(kind, names):
            shared = sorted(set(names) & {clash.spec.name, *clash.spec.aliases})
            what = f"{KIND_LABELS[kind]} '{shared[0]}'"
            if clash.plugin is info:
                self.conflicts.append(f"{info.who} declares {what} twice; give each spec a distinct name and aliases")
                return
            if spec.override and not clash.spec.override:
                warnings.warn(
                    f"{what} from {info.who} overrides the one from {clash.plugin.who}", PluginWarning, stacklevel=4
                )
                self._remove(clash)
                continue
            if clash.spec.override and not spec.override:
                warnings.warn(
                    f"{what} from {clash.plugin.who} overrides the one from {info.who}", PluginWarning, stacklevel=4
                )
                info.overridden.setdefault(kind, []).append(spec.name)
                return
            both = "both set override=True" if spec.override else "neither sets override=True"
            self.conflicts.append(
                f"{what} is provided by both {clash.plugin.who} and {info.who} ({both}); "
                f"uninstall one, disable one with MINISGL_DISABLE_PLUGINS={info.name}, "
                f"or set override=True on exactly one of the two specs"
            )
            return
        self.components[kind][spec.name] = Provided(spec, info)
        info.provides.setdefault(kind, []).append(spec.name)

    def _remove(self, provided: Provided) -> None:
        kind, name = provided.spec.kind, provided.spec.name
        del self.components[kind][name]
        loser = provided.plugin
        loser.provides[kind].remove(name)
        if not loser.provides[kind]:
            del loser.provides[kind]
        loser.overridden.setdefault(kind, []).append(name)

    def build(self, plugins: list[PluginInfo]) -> PluginRegistry:
        return PluginRegistry(plugins, self.components, self.conflicts)
