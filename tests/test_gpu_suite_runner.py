"""tests/gpu_suite.py on a made-up tree of test files (no GPU needed).

The fake suite's marker is ``fakegpu``; its "CUDA error" is a test that raises
the message a device-side assert produces, its crash a test that calls
``os._exit``. The runner must give each bad test its own failure, run the
rest of its file in a fresh process and count everything once.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import gpu_suite
import pytest
from gpu_suite import Options, Suite, discover, unmarked_cuda_files
from gpu_suite_report import FileResult

ROOT = Path(__file__).resolve().parent.parent

FILES = {
    "core/tests/test_mixed.py": """
        import pytest

        @pytest.mark.fakegpu
        def test_passes():
            print("RESULT KV pages: 2.00x")
            print("not a figure")

        @pytest.mark.fakegpu
        def test_skips():
            pytest.skip("no device")

        @pytest.mark.fakegpu
        def test_fails():
            # An ordinary failure: the traceback shows this line, "CUDA error: device-side assert",
            # but the exception says nothing of CUDA, so the process goes on.
            print("RESULT from a failing test")
            assert 1 == 2

        def test_not_marked_so_not_selected():
            pass
    """,
    "core/tests/test_poisons.py": """
        import pytest

        pytestmark = pytest.mark.fakegpu

        def test_before():
            pass

        def test_device_assert():
            raise RuntimeError("CUDA error: device-side assert triggered")

        def test_after():
            pass

        @pytest.mark.parametrize("n", [1, 2])
        def test_after_param(n):
            pass
    """,
    "plugins/minisgl-plugin-x/tests/test_dies.py": """
        import os
        import pytest

        pytestmark = pytest.mark.fakegpu

        @pytest.fixture(scope="module")
        def shared():
            return object()

        def test_first(shared):
            pass

        def test_crash(shared):
            os._exit(1)

        def test_second(shared):
            pass

        def test_third(shared):
            pass
    """,
    "tests/test_hangs.py": """
        import time
        import pytest

        pytestmark = pytest.mark.fakegpu

        def test_quick():
            pass

        def test_hang():
            time.sleep(60)

        def test_never_reached():
            pass
    """,
    "tests/test_skipped_module.py": """
        import pytest

        pytestmark = pytest.mark.fakegpu
        pytest.importorskip("no_such_module_here")
    """,
    "tests/test_broken.py": """
        import pytest
        import no_such_module_here

        pytestmark = pytest.mark.fakegpu
    """,
    "tests/test_cpu_only.py": """
        def test_plain():
            pass
    """,
    "tests/test_unmarked_gpu.py": """
        import pytest
        import torch

        pytestmark = pytest.mark.skipif(
            not TORCH_CUDA_IS_AVAILABLE, reason="needs a CUDA GPU"
        )
    """,
}
# Filled in when written: spelled out here, it would make this file look like an unmarked GPU test.
SPELLED_LATER = {"TORCH_CUDA_IS_AVAILABLE": "torch." + "cuda.is_available()"}


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The fake test processes need no installed pytest plugin; loading them all takes seconds a process.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    fakegpu: a fake CUDA test\n")
    for rel, text in FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for placeholder, code in SPELLED_LATER.items():
            text = text.replace(placeholder, code)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def _run(root: Path, *names: str, **kw: object) -> dict[str, FileResult]:
    kw.setdefault("min_start", 0.5)
    opts = Options(root=root, marker="fakegpu", **kw)  # type: ignore[arg-type]
    files = [root / n for n in names]
    return {r.path: r for r in Suite(opts, echo=False).run(files)}


def _counts(r: FileResult) -> dict[str, int]:
    return {c: r.count(c) for c in ("passed", "failed", "skipped", "errors", "not run")}


def test_discovers_marked_files_only_and_flags_unmarked_gpu_files(fake_root: Path) -> None:
    found = [f.relative_to(fake_root).as_posix() for f in discover(fake_root, marker="fakegpu")]
    assert found == [
        "core/tests/test_mixed.py",
        "core/tests/test_poisons.py",
        "plugins/minisgl-plugin-x/tests/test_dies.py",
        "tests/test_broken.py",
        "tests/test_hangs.py",
        "tests/test_skipped_module.py",
    ]
    flagged = [f.relative_to(fake_root).as_posix() for f in unmarked_cuda_files(fake_root, "fakegpu")]
    assert flagged == ["tests/test_unmarked_gpu.py"]


def test_counts_and_reruns_after_poisoning_and_crash(fake_root: Path) -> None:
    results = _run(
        fake_root,
        "core/tests/test_mixed.py",
        "core/tests/test_poisons.py",
        "plugins/minisgl-plugin-x/tests/test_dies.py",
        "tests/test_skipped_module.py",
        "tests/test_broken.py",
        jobs=2,
    )
    mixed = results["core/tests/test_mixed.py"]
    assert _counts(mixed) == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0, "not run": 0}
    assert mixed.processes == 1 and not mixed.ok
    assert "assert 1 == 2" in mixed.messages["core/tests/test_mixed.py::test_fails"]

    # The CUDA error stops its process; the three tests after it run in a second one.
    poisons = results["core/tests/test_poisons.py"]
    assert _counts(poisons) == {"passed": 4, "failed": 1, "skipped": 0, "errors": 0, "not run": 0}
    assert poisons.processes == 2
    assert poisons.outcomes["core/tests/test_poisons.py::test_device_assert"] == "failed"
    assert poisons.outcomes["core/tests/test_poisons.py::test_after_param[2]"] == "passed"
    assert any("3 tests re-run" in n and "test_device_assert" in n for n in poisons.notes)

    # The crash costs only the test that crashed, even with a module fixture to set up again.
    dies = results["plugins/minisgl-plugin-x/tests/test_dies.py"]
    assert _counts(dies) == {"passed": 3, "failed": 1, "skipped": 0, "errors": 0, "not run": 0}
    assert dies.processes == 2
    crash = dies.messages["plugins/minisgl-plugin-x/tests/test_dies.py::test_crash"]
    assert crash.startswith("the test process died (exit code 1)")

    skipped = results["tests/test_skipped_module.py"]
    assert _counts(skipped) == {"passed": 0, "failed": 0, "skipped": 1, "errors": 0, "not run": 0}
    assert skipped.ok

    broken = results["tests/test_broken.py"]
    assert _counts(broken) == {"passed": 0, "failed": 0, "skipped": 0, "errors": 1, "not run": 0}
    assert "no_such_module_here" in broken.messages["tests/test_broken.py"]


def test_a_file_out_of_time_fails_the_running_test_and_leaves_the_rest_unrun(fake_root: Path) -> None:
    r = _run(fake_root, "tests/test_hangs.py", file_timeout=5.0)["tests/test_hangs.py"]
    assert _counts(r) == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0, "not run": 1}
    assert r.messages["tests/test_hangs.py::test_hang"].startswith("timed out")
    assert r.processes == 1 and r.seconds < 30 and not r.ok


def test_tests_left_for_a_rerun_without_time_for_it_count_as_not_run(fake_root: Path) -> None:
    # A fresh process needs min_start seconds; with the file's whole limit that short, no re-run fits.
    r = _run(fake_root, "core/tests/test_poisons.py", file_timeout=4.0, min_start=4.0)["core/tests/test_poisons.py"]
    assert _counts(r) == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0, "not run": 3}
    assert r.processes == 1 and not r.ok
    assert r.notes[-1] == "3 tests not run: too little time left for a fresh process"


def test_no_process_starts_once_the_suite_is_out_of_time(fake_root: Path) -> None:
    r = _run(fake_root, "core/tests/test_mixed.py", total_timeout=0.1)["core/tests/test_mixed.py"]
    assert r.not_run is None and r.processes == 0 and not r.ok


def test_main_writes_the_reports_and_fails_on_failures(fake_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["--root", str(fake_root), "--marker", "fakegpu", "--out", str(out), "--commit", "abc123"]
    rc = gpu_suite.main([*argv, str(fake_root / "core/tests")])
    assert rc == 1
    doc = json.loads((out / "gpu-suite.json").read_text())
    assert doc["commit"] == "abc123" and doc["ok"] is False
    assert doc["totals"] == {"passed": 5, "failed": 2, "skipped": 1, "errors": 0, "not_run": 0}
    assert [f["file"] for f in doc["files"]] == ["core/tests/test_mixed.py", "core/tests/test_poisons.py"]
    md = (out / "gpu-suite.md").read_text()
    assert "| core/tests/test_poisons.py | 4 | 1 | 0 | 0 | 0 |" in md
    assert "failed: `core/tests/test_poisons.py::test_device_assert`: call: RuntimeError: CUDA error" in md
    # The figures passing tests printed (RESULT lines), and only theirs.
    assert doc["files"][0]["results"] == {"core/tests/test_mixed.py::test_passes": ["KV pages: 2.00x"]}
    assert "## Figures the tests measured\n\n- `core/tests/test_mixed.py::test_passes`: KV pages: 2.00x" in md
    assert "failing test" not in md
    assert (out / "logs" / "core__tests__test_poisons.py.log").read_text().count("gpu_suite_plugin") == 2

    assert gpu_suite.main([*argv, str(fake_root / "tests/test_skipped_module.py")]) == 0
    assert gpu_suite.main(["--root", str(fake_root), "--marker", "nosuchmarker"]) == 2


def test_this_repository_marks_every_gpu_test_file() -> None:
    assert [f.relative_to(ROOT).as_posix() for f in unmarked_cuda_files(ROOT)] == []
    found = {f.relative_to(ROOT).as_posix() for f in discover(ROOT)}
    assert "core/tests/test_engine_gpu.py" in found
    assert "plugins/minisgl-plugin-flashinfer/tests/test_flashinfer_backend.py" in found
