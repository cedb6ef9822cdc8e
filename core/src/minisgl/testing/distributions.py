"""Fake installed distributions, for testing plugin discovery without pip.

:func:`write_distribution` lays out what an installer would leave in
site-packages (a ``NAME-VERSION.dist-info`` folder with ``METADATA`` and
``entry_points.txt``, plus the plugin's modules). Put the folder on
``PYTHONPATH`` of a subprocess (see :func:`subprocess_env`) and
``importlib.metadata`` finds the plugin exactly as if it had been installed.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path


def write_distribution(
    root: str | Path,
    name: str,
    version: str = "0.1.0",
    *,
    entry_points: Mapping[str, str] | None = None,
    requires: Iterable[str] = ("minisgl>=0.3,<0.4",),
    files: Mapping[str, str] | None = None,
    group: str = "minisgl",
) -> Path:
    """Write distribution ``name`` into folder ``root`` and return ``root``.

    ``entry_points`` maps entry names to ``"module"`` or ``"module:attr"`` in
    ``group``; ``requires`` become ``Requires-Dist`` lines; ``files`` maps paths
    relative to ``root`` (e.g. ``"hello_plugin/__init__.py"``) to their source,
    dedented.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    # Installers normalise the folder name: runs of "-", "_", "." become "_".
    info = root / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(metadata) + "\n")
    lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in (entry_points or {}).items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for rel, source in (files or {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def subprocess_env(
    *paths: str | Path, environ: Mapping[str, str] | None = None, **overrides: str | None
) -> dict[str, str]:
    """An environment with ``paths`` first on ``PYTHONPATH``; ``overrides`` set (or, when None, remove) variables.

    The minisgl plugin variables are removed unless given, so the caller's shell
    does not leak into a test.
    """
    env = dict(os.environ if environ is None else environ)
    for var in ("MINISGL_PLUGINS", "MINISGL_DISABLE_PLUGINS", "MINISGL_STRICT_PLUGINS"):
        env.pop(var, None)
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), *([old] if old else [])])
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
