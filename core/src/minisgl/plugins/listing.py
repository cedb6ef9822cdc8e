"""``minisgl plugins [--json]``: what is installed, what is active, what each plugin provides.

It loads plugins exactly as an engine would (same environment variables), but
never builds a component, so it runs in well under a second with no GPU and no
torch import. ``--device cuda`` (or ``cpu``) also runs each component's
``is_supported`` check for that device and shows why those that cannot run there
are unsupported. The exit status is 1 when an engine would refuse to start with
this plugin set (a name clash, or a skipped plugin under MINISGL_STRICT_PLUGINS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, TextIO

from .manager import ENV_ALLOW, ENV_BLOCK, ENV_STRICT, _env_flag, core_version, load_plugins
from .registry import PluginRegistry
from .specs import KINDS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisgl plugins",
        description="List the installed minisgl plugins, their status and the components each provides.",
        epilog=f"Honours {ENV_ALLOW} (allow-list), {ENV_BLOCK} (block-list) and {ENV_STRICT}.",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.add_argument(
        "--device",
        metavar="DEVICE",
        help="also check each component against DEVICE (cpu, cuda) and say why it cannot run there",
    )
    return p


def unsupported(registry: PluginRegistry, device: str) -> dict[str, dict[str, str]]:
    """Per kind, the components that cannot run on ``device`` and why (``""``: no reason given)."""
    found: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        for spec in registry.specs(kind):
            reason = spec.unsupported_reason(device)
            if reason is not None:
                found.setdefault(kind, {})[spec.name] = reason
    return found


def to_json(
    registry: PluginRegistry, warning_messages: Sequence[str] = (), device: str | None = None
) -> dict[str, Any]:
    """The listing as plain data: plugins, components per kind, conflicts and warnings.

    With ``device``, each component row also says whether it runs there and, if not, why.
    """
    missing = unsupported(registry, device) if device else {}
    components: dict[str, list[dict[str, Any]]] = {}
    for kind in KINDS:
        rows = []
        for spec in registry.specs(kind):
            plugin = registry.provider(kind, spec.name)
            row: dict[str, Any] = {
                "name": spec.name,
                "aliases": list(spec.aliases),
                "priority": spec.priority,
                "override": spec.override,
                "description": spec.description,
                "factory": spec.factory_ref,
                "plugin": plugin.name,
                "distribution": plugin.distribution,
            }
            if device:
                reason = missing.get(kind, {}).get(spec.name)
                row["supported"] = reason is None
                row["unsupported_reason"] = reason or ""
            rows.append(row)
        components[kind] = rows
    listing: dict[str, Any] = {
        "core_version": core_version(),
        "plugins": [p.to_json() for p in registry.plugins],
        "components": components,
        "conflicts": list(registry.conflicts),
        "warnings": list(warning_messages),
    }
    if device:
        listing["device"] = device
    return listing


def _provides_lines(registry: PluginRegistry, provides: dict[str, list[str]]) -> list[str]:
    lines = []
    for kind in KINDS:
        names = provides.get(kind)
        if not names:
            continue
        shown = []
        for n in names:
            aliases = registry.get(kind, n).aliases if registry.has(kind, n) else ()
            word = "alias" if len(aliases) == 1 else "aliases"
            shown.append(f"{n} ({word} {', '.join(aliases)})" if aliases else n)
        lines.append(f"{kind}: {', '.join(shown)}")
    return lines


def render_table(registry: PluginRegistry, device: str | None = None) -> str:
    """The human-readable listing: one row per plugin, one line per component kind it provides
    (with ``device``, one more line per component that cannot run there, with the reason)."""
    header = ("DISTRIBUTION", "VERSION", "ENTRY", "STATUS", "PROVIDES")
    missing = unsupported(registry, device) if device else {}
    rows: list[tuple[str, str, str, str, list[str]]] = []
    for p in registry.plugins:
        detail = _provides_lines(registry, p.provides)
        for kind, names in p.provides.items():
            for n in names:
                if n in missing.get(kind, {}):
                    reason = missing[kind][n]
                    detail.append(f"{kind} {n}: unsupported on {device}" + (f": {reason}" if reason else ""))
        detail += [f"{kind}: {', '.join(names)} (overridden)" for kind, names in p.overridden.items()]
        if p.error:
            detail.append(p.error)
        rows.append((p.distribution or "-", p.version or "-", p.name, p.status, detail or ["-"]))
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(4)]

    def line(cells: Sequence[str], last: str) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + "  " + last

    out = [line(header[:4], header[4])]
    for *cells, detail in rows:
        out.append(line(cells, detail[0]))
        out += [line([""] * 4, d) for d in detail[1:]]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Entry of ``minisgl plugins``: print the listing; 1 when an engine would refuse to start, else 0."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = load_plugins(strict=False, raise_conflicts=False)
    messages = [str(w.message) for w in caught]
    strict = _env_flag(os.environ.get(ENV_STRICT))
    skipped = [p for p in registry.plugins if p.status in ("failed", "incompatible")] if strict else []
    if args.json:
        print(json.dumps(to_json(registry, messages, args.device), indent=2), file=out)
    else:
        print(render_table(registry, args.device), file=out)
    for m in messages:
        print(f"warning: {m}", file=err)
    for c in registry.conflicts:
        print(f"error: {c}", file=err)
    for p in skipped:
        print(f"error: {p.who} is {p.status} and {ENV_STRICT} is set, so an engine would not start", file=err)
    return 1 if registry.conflicts or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
