"""The plugin-author guide's example (docs/examples/minisgl-plugin-hello) works as documented.

Instead of pip-installing it, the test writes the ``.dist-info`` folder pip would
write, from the example's own pyproject.toml (name, version, dependencies, entry
points), and puts it and the example's ``src`` on PYTHONPATH of a subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from minisgl.testing.distributions import subprocess_env, write_distribution

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "minisgl-plugin-hello"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which minisgl-plugin-hello looks installed."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = write_distribution(
        tmp_path_factory.mktemp("site"),
        project["name"],
        project["version"],
        entry_points=project["entry-points"]["minisgl"],
        requires=project["dependencies"],
    )
    # One torch thread: the subprocess shares two cores with the test runner.
    return subprocess_env(site, EXAMPLE / "src", OMP_NUM_THREADS="1")


def test_example_declares_what_the_guide_says() -> None:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert project["name"] == "minisgl-plugin-hello"
    assert project["entry-points"]["minisgl"] == {"hello": "minisgl_plugin_hello.plugin"}
    assert "minisgl>=0.3,<0.4" in project["dependencies"]


def test_listed_as_active(installed: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "plugins", "--json"],
        env=installed,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    hello = next(p for p in data["plugins"] if p["name"] == "hello")
    assert (hello["distribution"], hello["version"], hello["status"], hello["provides"]) == (
        "minisgl-plugin-hello",
        "0.1.0",
        "active",
        {"attention": ["hello"]},
    )
    row = next(c for c in data["components"]["attention"] if c["name"] == "hello")
    assert (row["aliases"], row["factory"]) == (["hi"], "minisgl_plugin_hello.backend:HelloAttnBackend")


def test_example_tests_pass(installed: dict[str, str]) -> None:
    """The example's own suite: the full conformance kit against 'hello', plus its particular tests."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
        env=installed,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=EXAMPLE,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
    assert int(summary.split()[0]) == 12 * 4 + 2  # every case of every scenario, and the two plugin tests


def _setuptools_version() -> tuple[int, ...]:
    try:
        import setuptools
    except ImportError:
        return ()
    return tuple(int(p) for p in setuptools.__version__.split(".")[:1])


@pytest.mark.skipif(_setuptools_version() < (68,), reason="needs setuptools>=68 to build the example offline")
def test_pip_installs_the_example(tmp_path: Path) -> None:
    """A real build of the example's pyproject.toml (offline: no build isolation, no dependencies)."""
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = shutil.copytree(EXAMPLE, tmp_path / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "plugins", "--json"],
        env=subprocess_env(target),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    hello = next(p for p in json.loads(proc.stdout)["plugins"] if p["name"] == "hello")
    assert (hello["status"], hello["provides"]) == ("active", {"attention": ["hello"]})
