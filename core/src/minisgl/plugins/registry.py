"""The registry built once at start-up from the active plugins' specs, and how name clashes are settled.

It is plain data (per kind, name -> spec, the plugin that provided it, and its rank under ``auto``);
engines read it, nothing on the per-step path touches pluggy.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from .specs import KIND_LABELS, KINDS, ComponentSpec, Kind, PluginWarning, UnknownComponentError

Status = Literal["active", "disabled", "failed", "incompatible"]


@dataclass
class PluginInfo:
    """One plugin and what became of it: ``provides`` (per kind, the names it contributes) and
    ``overridden`` (the names another plugin's ``override=True`` spec replaced); ``error`` says why
    a plugin is not active."""

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
        """``plugin 'fa' (minisgl-plugin-fa 0.2.0)``: how messages name this plugin."""
        return (
            f"plugin '{self.name}' ({self.distribution} {self.version})"
            if self.distribution
            else f"plugin '{self.name}'"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Entry:
    spec: ComponentSpec
    plugin: PluginInfo
    rank: tuple[int, int]  # (position of the plugin in pluggy's call order, position in its list)


class PluginRegistry:
    """Every component kind's specs. ``plugins`` lists every plugin found (active or not);
    ``conflicts`` the clashes tolerated when loaded with ``raise_conflicts=False`` (for listings)."""

    def __init__(self, plugins: list[PluginInfo] | None = None) -> None:
        self.plugins = plugins if plugins is not None else []
        self.conflicts: list[str] = []
        self._table: dict[Kind, dict[str, Entry]] = {k: {} for k in KINDS}

    def add(self, spec: ComponentSpec, plugin: PluginInfo, rank: tuple[int, int] = (0, 0)) -> None:
        """Register ``spec``; a clash with another spec's name or alias is recorded in ``conflicts``,
        unless exactly one of the two sets ``override=True``: that one wins, with a warning."""
        kind, table, names = spec.kind, self._table[spec.kind], {spec.name, *spec.aliases}
        for old in [e for e in table.values() if names & {e.spec.name, *e.spec.aliases}]:
            what = f"{KIND_LABELS[kind]} '{sorted(names & {old.spec.name, *old.spec.aliases})[0]}'"
            if old.plugin is plugin:
                self.conflicts.append(f"{plugin.who} declares {what} twice; give each spec a distinct name and aliases")
                return
            if spec.override == old.spec.override:
                both = "both set override=True" if spec.override else "neither sets override=True"
                self.conflicts.append(
                    f"{what} is provided by both {old.plugin.who} and {plugin.who} ({both}); uninstall one, "
                    f"disable one with MINISGL_DISABLE_PLUGINS={plugin.name}, or set override=True on exactly one "
                    "of the two specs"
                )
                return
            winner, loser, lost = (
                (plugin, old.plugin, old.spec.name) if spec.override else (old.plugin, plugin, spec.name)
            )
            warnings.warn(f"{what} from {winner.who} overrides the one from {loser.who}", PluginWarning, stacklevel=4)
            loser.overridden.setdefault(kind, []).append(lost)
            if not spec.override:
                return
            del table[lost]
            loser.provides[kind].remove(lost)
            if not loser.provides[kind]:
                del loser.provides[kind]
        table[spec.name] = Entry(spec, plugin, rank)
        plugin.provides.setdefault(kind, []).append(spec.name)

    def _entry(self, kind: Kind, name: str) -> Entry:
        for entry in self._table[kind].values():
            if name == entry.spec.name or name in entry.spec.aliases:
                return entry
        raise UnknownComponentError(self._unknown_message(kind, name))

    def active_plugin_names(self) -> list[str]:
        """Entry names of the active plugins: what a parent hands to its worker processes (``only=``)."""
        return [p.name for p in self.plugins if p.status == "active"]

    def names(self, kind: Kind) -> list[str]:
        return sorted(self._table[kind])

    def has(self, kind: Kind, name: str) -> bool:
        return any(name == e.spec.name or name in e.spec.aliases for e in self._table[kind].values())

    def specs(self, kind: Kind) -> list[ComponentSpec]:
        """Every ``kind`` spec, sorted by name."""
        return [self._table[kind][n].spec for n in self.names(kind)]

    def get(self, kind: Kind, name: str) -> ComponentSpec:
        """The spec for ``name`` or an alias; :class:`UnknownComponentError` saying what there is otherwise."""
        return self._entry(kind, name).spec

    def provider(self, kind: Kind, name: str) -> PluginInfo:
        return self._entry(kind, name).plugin

    def supported(self, kind: Kind, device: str) -> list[str]:
        return [s.name for s in self.specs(kind) if s.supports(device)]

    def pick(self, kind: Kind, name: str, device: str) -> ComponentSpec:
        """``name`` if it runs on ``device`` (else why not); ``"auto"``: the best ranked that does."""
        if name == "auto":
            return self.ranked(kind, device)[0]
        spec = self.get(kind, name)
        reason = spec.unsupported_reason(device)
        if reason is not None:
            raise UnknownComponentError(
                f"{spec.label} does not support device '{device}'{f' ({reason})' if reason else ''}; "
                f"{KIND_LABELS[kind]}s that do: {', '.join(self.supported(kind, device)) or 'none'}"
            )
        return spec

    def ranked(self, kind: Kind, device: str) -> list[ComponentSpec]:
        """The ``kind`` specs that run on ``device``, best first: by ``priority``, then by pluggy's call
        order of the plugins' hooks (tryfirst ... trylast), then by each plugin's list order."""
        entries = sorted(self._table[kind].values(), key=lambda e: (-e.spec.priority, e.rank))
        found = [e.spec for e in entries if e.spec.supports(device)]
        if not found:
            raise UnknownComponentError(
                f"no installed {KIND_LABELS[kind]} supports device '{device}'; installed: {self._installed(kind)}"
            )
        return found

    def _installed(self, kind: Kind) -> str:
        table = self._table[kind]
        return (
            ", ".join(f"{n} ({table[n].plugin.distribution or table[n].plugin.name})" for n in sorted(table)) or "none"
        )

    def _unknown_message(self, kind: Kind, name: str) -> str:
        msg = f"unknown {KIND_LABELS[kind]} '{name}'; installed: {self._installed(kind)}."
        known = [n for s in self.specs(kind) for n in (s.name, *s.aliases)]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        if close:
            msg += f" Did you mean '{close[0]}'?"
        inactive = [f"{p.name} ({p.status}: {p.error})" for p in self.plugins if p.status != "active"]
        if inactive:
            msg += f" Installed plugins that are not active: {'; '.join(inactive)}."
        return msg + " `minisgl plugins` lists each plugin and what it provides; docs/plugins.md says how to add one."
