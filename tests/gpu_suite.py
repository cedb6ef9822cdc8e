"""The GPU suite: every CUDA test of every package, each test file in its own pytest process.

    python3 tests/gpu_suite.py --out DIR [--jobs N] [--file-timeout S] [--total-timeout S]
                               [--require-cuda] [PATH ...] [-- PYTEST-ARGS]

A CUDA test is one marked ``cuda`` (``pytestmark = [pytest.mark.cuda, ...]`` or a
decorator); a test file with such a mark under core/tests, plugins/*/tests or
tests/ belongs to the suite, and only its ``cuda`` tests run (``-m cuda``).
Needs only pytest and the project importable (installed, or on PYTHONPATH).

Isolation: a CUDA error such as a device-side assert leaves the process's CUDA
context unusable, so every later test of that process would fail too. Each
file runs in a fresh process; when a process dies, or a test fails with such an
error (tests/gpu_suite_plugin.py stops the session then), the tests of that
file that have not run yet run in a new process, so the bad test costs only
itself. ``--file-timeout`` bounds each file (all its processes together),
``--total-timeout`` the whole suite; a test running when its file's time runs
out counts as failed and the rest as not run.

Prints a table (file, passed, failed, skipped, errors, not run, seconds) and,
with ``--out``, writes it to DIR/gpu-suite.md and DIR/gpu-suite.json, with each
file's pytest output under DIR/logs/. Exit status 0 only when nothing failed,
errored or was left unrun; 2 for a usage problem (no test files, no GPU under
``--require-cuda``). See docs/testing.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gpu_suite_plugin as plugin
from gpu_suite_plugin import Process, parse_record
from gpu_suite_report import COLUMNS, FileResult, commit, failure_lines, machine, table, totals, write_reports

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEST_ROOTS = ("core/tests", "plugins/*/tests", "tests")
# pytest's exit codes for a run that went through: all passed, some failed, nothing selected.
NORMAL_EXIT = {0, 1, 5}


# ------------------------------------------------------------------ discovery
def _marked(text: str, marker: str) -> bool:
    return re.search(rf"\bmark\.{re.escape(marker)}\b", text) is not None


def _test_files(paths: Iterable[Path]) -> list[Path]:
    files: set[Path] = set()
    for path in paths:
        if path.is_file():
            files.add(path.resolve())
        elif path.is_dir():
            files.update(p.resolve() for p in path.rglob("test_*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def default_paths(root: Path) -> list[Path]:
    return [p for pattern in TEST_ROOTS for p in sorted(root.glob(pattern)) if p.is_dir()]


def discover(root: Path, paths: Sequence[Path] = (), marker: str = "cuda") -> list[Path]:
    """Test files under ``paths`` (default: every package's tests) with a test marked ``marker``."""
    return [f for f in _test_files(paths or default_paths(root)) if _marked(f.read_text(encoding="utf-8"), marker)]


# A skip on CUDA being absent, or a conformance class's ``device = "cuda"``: tests that need a GPU.
_NEEDS_CUDA = re.compile(
    r"skipif\([^)]*?cuda\.(is_available|device_count)|^\s+device = [\"']cuda[^\"']*[\"']\s*$", re.M
)


def unmarked_cuda_files(root: Path, marker: str = "cuda") -> list[Path]:
    """Test files that look like they need a GPU but carry no ``marker`` mark: the suite would miss them."""
    found = []
    for f in _test_files(default_paths(root)):
        text = f.read_text(encoding="utf-8")
        if _NEEDS_CUDA.search(text) and not _marked(text, marker):
            found.append(f)
    return found


# --------------------------------------------------------------------- runner
@dataclass
class Options:
    """How :class:`Suite` runs (the command line's options; see :func:`main`)."""

    root: Path = ROOT
    marker: str = "cuda"
    file_timeout: float = 600.0
    total_timeout: float = 3600.0
    max_processes: int = 8  # per file; each re-run is owed to one bad test, so this caps the bad tests
    jobs: int = 1
    min_start: float = 10.0  # a process needs seconds to import torch: none starts with less time left
    pytest_args: Sequence[str] = ()
    log_dir: Path | None = None


def _died(proc: Process) -> str:
    if proc.returncode is None:
        return "killed at its time limit"
    if proc.returncode < 0:
        return f"killed by {signal.Signals(-proc.returncode).name}"
    return f"exit code {proc.returncode}"


class Suite:
    """Runs test files (in parallel up to ``jobs``), each in as many processes as its bad tests need."""

    def __init__(self, opts: Options, *, echo: bool = True):
        self.opts = opts
        self.echo = echo
        self.deadline = time.monotonic() + opts.total_timeout
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def _say(self, text: str) -> None:
        if self.echo:
            print(text, flush=True)

    def run(self, files: Sequence[Path]) -> list[FileResult]:
        with ThreadPoolExecutor(max_workers=max(1, self.opts.jobs)) as pool:
            try:
                return list(pool.map(self.run_file, files))
            except KeyboardInterrupt:
                self.deadline = 0.0  # no new process starts
                with self._lock:
                    for p in self._live:
                        os.killpg(p.pid, signal.SIGKILL)
                raise

    def run_file(self, path: Path) -> FileResult:
        rel = _relative(path, self.opts.root)
        result = FileResult(rel)
        file_deadline = time.monotonic() + self.opts.file_timeout
        log = self._log_path(rel)
        with tempfile.TemporaryDirectory(prefix="gpu-suite-") as tmp:
            deselect = Path(tmp, "deselect.txt")
            deselect.touch()
            while True:
                now = time.monotonic()
                left = min(file_deadline, self.deadline) - now
                if result.processes == 0 and self.deadline - now < self.opts.min_start:
                    result.not_run = None
                    result.notes.append("not started: the suite's time limit was spent")
                    break
                if result.processes > 0 and left < self.opts.min_start:
                    result.notes.append(f"{result.not_run} tests not run: too little time left for a fresh process")
                    break
                record = Path(tmp, f"record-{result.processes}.jsonl")
                proc, tail = self._run_process(path, record, deselect, log, left)
                result.processes += 1
                result.seconds += proc.seconds
                if not self._absorb(result, proc, tail, deselect):
                    break
        if result.not_run is None:
            self._say(f"{rel}: not started (suite time limit)")
        else:
            counts = ", ".join(f"{result.count(c)} {c}" for c in COLUMNS if result.count(c))
            self._say(f"{rel}: {counts or 'no tests'} in {result.seconds:.1f} s ({result.processes} process(es))")
        return result

    def _absorb(self, result: FileResult, proc: Process, tail: str, deselect: Path) -> bool:
        """Merge one process into the file's result; True when the rest of the file needs another process
        (``result.not_run`` then counts the tests it would run)."""
        result.not_run = 0
        result.outcomes.update(proc.outcomes)
        result.messages.update(proc.messages)
        result.results.update(proc.results)
        if proc.running is not None:
            why = "timed out" if proc.returncode is None else f"the test process died ({_died(proc)})"
            result.outcomes[proc.running] = "failed"
            result.messages[proc.running] = f"{why}; output before that:\n{tail}"
        if proc.collected is None:
            if not proc.outcomes:
                result.problems.append(f"the test process ended before collecting ({_died(proc)}):\n{tail}")
            return False
        remaining = [t for t in proc.collected if t not in result.outcomes]
        if proc.returncode is None:
            result.not_run = len(remaining)
            if remaining:
                result.notes.append(f"{len(remaining)} tests not run: the time limit was spent")
            return False
        if proc.ended and proc.poisoned is None:
            if proc.exitstatus not in NORMAL_EXIT and not any(o == "error" for o in proc.outcomes.values()):
                result.problems.append(f"pytest exited with status {proc.exitstatus}:\n{tail}")
            return False
        culprit = proc.poisoned or proc.running
        if not remaining:
            if culprit is None:
                result.problems.append(f"the test process died after its tests ({_died(proc)}):\n{tail}")
            return False
        why = f"a CUDA error in {culprit}" if proc.poisoned else f"the process died ({_died(proc)}) in {culprit}"
        if result.processes >= self.opts.max_processes:
            result.not_run = len(remaining)
            result.notes.append(f"{len(remaining)} tests not run after {why}: {result.processes} processes used")
            return False
        result.not_run = len(remaining)
        result.notes.append(f"{len(remaining)} tests re-run in a fresh process after {why}")
        self._say(f"{result.path}: {result.notes[-1]}")
        deselect.write_text("".join(t + "\n" for t in result.outcomes), encoding="utf-8")
        return True

    def _log_path(self, rel: str) -> Path | None:
        if self.opts.log_dir is None:
            return None
        self.opts.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.opts.log_dir / (rel.replace("/", "__") + ".log")
        path.write_text("")
        return path

    def _run_process(
        self, path: Path, record: Path, deselect: Path, log: Path | None, limit: float
    ) -> tuple[Process, str]:
        opts = self.opts
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_suite_plugin", "-q", "-rfE"]
        cmd += ["-m", opts.marker, *opts.pytest_args, _relative(path, opts.root)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
        env[plugin.RECORD_ENV], env[plugin.DESELECT_ENV] = str(record), str(deselect)
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
            out.write(f"$ {shlex.join(cmd[1:])}\n")
            out.flush()
            start = time.monotonic()
            # Its own process group: a test's children (servers, ranks) go down with it on a timeout.
            popen = subprocess.Popen(
                cmd, cwd=opts.root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            with self._lock:
                self._live.add(popen)
            try:
                returncode: int | None = popen.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
                returncode = None
            finally:
                with self._lock:
                    self._live.discard(popen)
            seconds = time.monotonic() - start
            out.seek(0)
            text = out.read()
        if log is not None:
            with log.open("a", encoding="utf-8") as f:
                f.write(text)
        lines = record.read_text(encoding="utf-8").splitlines() if record.exists() else []
        proc = parse_record(lines)
        proc.returncode, proc.seconds = returncode, seconds
        tail = "\n".join(text.splitlines()[-15:])
        return proc, tail


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------ CLI
def _cuda_visible() -> bool:
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_in:
        i = args_in.index("--")
        args_in, extra = args_in[:i], args_in[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Arguments after -- go to each pytest.")
    ap.add_argument("paths", nargs="*", type=Path, help="test files or folders (default: every package's tests)")
    ap.add_argument("--out", type=Path, help="write gpu-suite.md, gpu-suite.json and logs/ here")
    ap.add_argument("--jobs", type=int, default=1, help="test files run at once (default 1)")
    ap.add_argument("--file-timeout", type=float, default=600.0, help="seconds for one file, all its processes")
    ap.add_argument("--total-timeout", type=float, default=3600.0, help="seconds for the whole suite")
    ap.add_argument("--max-processes", type=int, default=8, help="processes one file may take (default 8)")
    ap.add_argument("--marker", default="cuda", help="the marker that selects tests (default cuda)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    ap.add_argument("--require-cuda", action="store_true", help="fail unless torch sees a GPU and a test passed")
    ap.add_argument("--commit", help="the commit tested, for the report (default: git rev-parse HEAD)")
    ap.add_argument("--list", action="store_true", help="list the test files and exit")
    args = ap.parse_args(args_in)

    root = args.root.resolve()
    for f in unmarked_cuda_files(root, args.marker):
        print(f"warning: {_relative(f, root)} skips without CUDA but has no '{args.marker}' mark: not in the suite")
    files = discover(root, args.paths, args.marker)
    if not files:
        print(f"no test file with a '{args.marker}' mark under {', '.join(map(str, args.paths)) or root}")
        return 2
    if args.list:
        print("\n".join(_relative(f, root) for f in files))
        return 0
    if args.require_cuda and not _cuda_visible():
        print("--require-cuda: torch sees no CUDA device here")
        return 2

    opts = Options(
        root=root,
        marker=args.marker,
        file_timeout=args.file_timeout,
        total_timeout=args.total_timeout,
        max_processes=args.max_processes,
        jobs=args.jobs,
        pytest_args=extra,
        log_dir=args.out / "logs" if args.out else None,
    )
    print(f"{len(files)} test files, {args.jobs} at a time", flush=True)
    start = time.monotonic()
    results = Suite(opts).run(files)
    seconds = time.monotonic() - start
    print()
    print(table(results, markdown=False))
    details = failure_lines(results)
    if details:
        print("\n" + "\n".join(details))
    ok = all(r.ok for r in results)
    if args.require_cuda and totals(results)["passed"] == 0:
        print("--require-cuda: no test passed")
        ok = False
    if args.out:
        header = {
            "command": shlex.join(["python3", "tests/gpu_suite.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(),
            "commit": args.commit or commit(root),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        }
        write_reports(args.out, results, header, seconds, ok)
        print(f"\nwrote {args.out / 'gpu-suite.md'} and {args.out / 'gpu-suite.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
