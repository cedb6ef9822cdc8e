"""The commands: ``minisgl bench`` (core's dispatcher, with and without this package) and ``minisgl-bench``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from minisgl_bench import cli

from minisgl import cli as core_cli


def test_dispatch_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("offline", "shared-prefix", "serve", "plot"):
        assert f"  {name} " in out


def test_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_minisgl_bench_runs_this_package(capsys: pytest.CaptureFixture[str]) -> None:
    assert core_cli.main(["bench", "--help"]) == 0
    assert "shared-prefix" in capsys.readouterr().out
    assert core_cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_minisgl_bench_without_this_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "minisgl_bench", None)  # what an import sees when it is not installed
    monkeypatch.setitem(sys.modules, "minisgl_bench.cli", None)
    assert core_cli.main(["bench", "offline"]) == 2
    err = capsys.readouterr().err
    assert "minisgl-bench" in err and "not installed" in err
    assert "pip install ./benchmarks/minisgl-bench" in err
    root = Path(core_cli.__file__).parents[3]
    if (root / "benchmarks").is_dir():  # a source checkout: the path named exists
        assert (root / "benchmarks" / "minisgl-bench" / "pyproject.toml").is_file()


def test_minisgl_bench_without_this_package_in_a_fresh_process() -> None:
    code = (
        "import sys; sys.modules['minisgl_bench'] = None; "
        "from minisgl.cli import main; sys.exit(main(['bench', '--help']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "pip install ./benchmarks/minisgl-bench" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_core_help_names_bench() -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "bench" in proc.stdout


def test_console_script() -> None:
    script = shutil.which("minisgl-bench", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("minisgl-bench is not installed as a distribution here")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "serve" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "minisgl_bench", "nope"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr
