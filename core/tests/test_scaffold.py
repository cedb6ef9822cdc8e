"""``minisgl plugin new``: each kind's package lists as a plugin and passes its own tests as generated."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from minisgl.scaffold import KINDS, ScaffoldError, create, main
from minisgl.testing.distributions import subprocess_env, write_distribution


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generated_plugin_lists_and_passes_its_tests(tmp_path: Path, kind: str) -> None:
    name = "demo_" + kind.replace("-", "_")
    root = create(name, kind, tmp_path, architecture="Phi3ForCausalLM" if kind == "model" else "")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX string: the table form is deprecated
    assert project["entry-points"]["minisgl"] == {name: f"minisgl_plugin_{name}.plugin"}
    # Installed (metadata on the path, as pip would leave it): `minisgl plugins` lists the component as active.
    site = write_distribution(
        tmp_path / "site",
        project["name"],
        project["version"],
        entry_points=project["entry-points"]["minisgl"],
        requires=project["dependencies"],
    )
    env = subprocess_env(site, root / "src")
    listing = subprocess.run(
        [sys.executable, "-m", "minisgl", "plugins", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    # A new component is chosen only by name: `auto` keeps what it chose before the plugin was installed.
    auto = listing.stdout.splitlines()[-1]
    assert auto.startswith("auto on cpu: ") and name not in auto, auto
    row = next(line for line in listing.stdout.splitlines() if line.startswith(project["name"]))
    provided = "Phi3ForCausalLM" if kind == "model" else name
    assert row.split()[2:] == [name, "active", f"{kind.replace('-', '_')}:", provided]
    # Its tests, as generated, against the kit.
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(root / "tests")],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout


def test_bad_requests_say_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ScaffoldError, match="lower case"):
        create("My-Kernel", "attention", tmp_path)
    with pytest.raises(ScaffoldError, match="unknown kind 'sampler'"):
        create("x", "sampler", tmp_path)
    with pytest.raises(ScaffoldError, match="needs --architecture"):
        create("phi", "model", tmp_path)
    create("taken", "moe", tmp_path)
    assert main(["new", "taken", "--kind", "moe", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
