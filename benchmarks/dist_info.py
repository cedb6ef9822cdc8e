"""Make a source tree's packages visible to importlib.metadata without installing them.

For TREE's core, every plugins/minisgl-plugin-*, and benchmarks/minisgl-bench where present, writes into SITE
the dist-info that entry-point discovery reads: name, version, the requirement on minisgl and the
[project.entry-points.minisgl] table, from each pyproject.toml. With --new-only, prints instead the entry
names of this checkout's plugins that TREE does not ship (for MINISGL_DISABLE_PLUGINS in TREE's runs).

    python3 benchmarks/dist_info.py TREE SITE
    python3 benchmarks/dist_info.py --new-only TREE
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def pyprojects(tree: Path) -> list[Path]:
    found = [tree / "core/pyproject.toml", *sorted(tree.glob("plugins/minisgl-plugin-*/pyproject.toml"))]
    return found + [p for p in [tree / "benchmarks/minisgl-bench/pyproject.toml"] if p.exists()]


def write(tree: Path, site: Path) -> None:
    for pyproject in pyprojects(tree):
        project = tomllib.loads(pyproject.read_text())["project"]
        name, version = project["name"], project["version"]
        requires = "".join(f"Requires-Dist: {r}\n" for r in project.get("dependencies", []) if r.startswith("minisgl"))
        entries = project.get("entry-points", {}).get("minisgl", {})
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")
        (info / "entry_points.txt").write_text("[minisgl]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


def new_only(tree: Path) -> str:
    here = sorted(Path("plugins").glob("minisgl-plugin-*"))
    return ",".join(p.name.removeprefix("minisgl-plugin-") for p in here if not (tree / p).is_dir())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--new-only"]:
        print(new_only(Path(sys.argv[2])))
    else:
        write(Path(sys.argv[1]), Path(sys.argv[2]))
