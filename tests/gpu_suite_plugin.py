"""The pytest plugin that tests/gpu_suite.py loads into each test process it starts (``-p gpu_suite_plugin``).

It writes one JSON line per event to the file named by ``MINISGL_GPU_SUITE_RECORD``,
flushed at once, so that the runner knows which tests ran even when the process
dies half-way: ``collected`` (the test ids), ``start`` and ``finish`` of each test,
``report`` of each phase, ``results`` (the lines starting ``RESULT `` a passing
test printed: the figures it measured), ``collect_error`` and ``collect_skip``
(a module skipped whole), ``poisoned`` and ``end``.

It also keeps one test's CUDA failure from being blamed on the next test or
from failing every later test of the process:

- after each test's call and teardown it synchronizes the device (when the test
  process has initialized CUDA), so an asynchronous kernel error fails the test
  that launched the kernel;
- a failure whose text says the CUDA context is unusable (device-side assert,
  illegal memory access, ...) stops the session; the runner then re-runs the
  tests not yet run in a fresh process.

Test ids listed in the file named by ``MINISGL_GPU_SUITE_DESELECT`` are
deselected (the ones an earlier process of the same file already ran).
Without ``MINISGL_GPU_SUITE_RECORD`` the plugin does nothing. :func:`parse_record`
reads a record back.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import pytest

RECORD_ENV = "MINISGL_GPU_SUITE_RECORD"
DESELECT_ENV = "MINISGL_GPU_SUITE_DESELECT"

RESULT_PREFIX = "RESULT "  # a line a test prints to put a figure it measured into the suite's report

# Errors after which the process's CUDA context (or its cuBLAS/NCCL handles) cannot be trusted.
# A false positive costs one process start; a miss costs every later test of the file.
POISON = re.compile(
    r"device-side assert|illegal memory access|CUDA error|CUBLAS_STATUS_|CUDNN_STATUS_|cudaError"
    r"|unspecified launch failure|misaligned address|illegal instruction|CUDA driver error"
)

_out: IO[str] | None = None
_session: pytest.Session | None = None


def _emit(event: str, **fields: Any) -> None:
    if _out is not None:
        _out.write(json.dumps({"event": event, **fields}) + "\n")
        _out.flush()


def _text(report: pytest.CollectReport | pytest.TestReport) -> str:
    return str(report.longrepr) if report.longrepr is not None else ""


def _errors(text: str) -> list[str]:
    """pytest's ``E   ...`` lines of a failure: the exception, without the source lines around it."""
    return [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]


def _summary(text: str) -> str:
    """The line that says what went wrong: the first ``E`` line, else the last line."""
    errors = _errors(text)
    lines = errors or [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if errors else lines[-1])[:500] if lines else ""


def _sync_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def pytest_configure(config: pytest.Config) -> None:
    global _out
    path = os.environ.get(RECORD_ENV)
    if path:
        _out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole session


def pytest_unconfigure(config: pytest.Config) -> None:
    global _out
    if _out is not None:
        _out.close()
        _out = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session
    _session = session


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get(DESELECT_ENV)
    if not path or _out is None:
        return
    with open(path, encoding="utf-8") as f:
        done = {line.rstrip("\n") for line in f if line.strip()}
    dropped = [item for item in items if item.nodeid in done]
    if dropped:
        items[:] = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=dropped)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit("collect_error", id=report.nodeid, message=_summary(_text(report)))
    elif report.skipped:  # a module-level skip (importorskip): no test of the module is collected
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else _text(report)
        _emit("collect_skip", id=report.nodeid, message=str(reason))


def pytest_collection_finish(session: pytest.Session) -> None:
    _emit("collected", ids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid: str) -> None:
    _emit("start", id=nodeid)


def pytest_runtest_logfinish(nodeid: str) -> None:
    _emit("finish", id=nodeid)


# After the test's own exception too: an error the sync raises then chains to it.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        _sync_cuda()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        _sync_cuda()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _out is None:
        return
    text = _text(report) if report.failed else ""
    _emit(
        "report",
        id=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        xfail=hasattr(report, "wasxfail"),
        seconds=round(report.duration, 3),
        message=_summary(text) if report.failed else "",
    )
    if report.when == "call" and report.passed:
        out = report.capstdout.splitlines()
        figures = [line[len(RESULT_PREFIX) :].strip() for line in out if line.startswith(RESULT_PREFIX)]
        if figures:
            _emit("results", id=report.nodeid, lines=figures)
    # The exception's lines only: the source in a traceback may mention these errors without raising them.
    if report.failed and POISON.search("\n".join(_errors(text)) or text):
        _emit("poisoned", id=report.nodeid, message=_summary(text))
        if _session is not None:
            _session.shouldstop = f"CUDA context unusable after {report.nodeid}; the runner re-runs the rest"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _emit("end", exitstatus=int(exitstatus))


# ------------------------------------------------------------- the record, read back
@dataclass
class Process:
    """What one pytest process reported (from the plugin's record) and how it ended."""

    collected: list[str] | None = None
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped/error
    messages: dict[str, str] = field(default_factory=dict)
    results: dict[str, list[str]] = field(default_factory=dict)  # test id -> the RESULT lines it printed
    running: str | None = None  # a test that started and did not finish
    poisoned: str | None = None
    ended: bool = False
    exitstatus: int | None = None
    returncode: int | None = None  # None: killed at its time limit
    seconds: float = 0.0


def _outcome(reports: list[dict]) -> str:
    """One test's outcome from its setup/call/teardown reports, as pytest counts it."""
    if any(r["when"] == "call" and r["outcome"] == "failed" for r in reports):
        return "failed"
    if any(r["outcome"] == "failed" for r in reports):
        return "error"
    if any(r["outcome"] == "skipped" for r in reports):
        return "skipped"
    if any(r["when"] == "call" for r in reports):
        return "passed"
    return "error"


def parse_record(lines: Iterable[str]) -> Process:
    proc = Process()
    reports: dict[str, list[dict]] = {}
    for line in lines:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a dying process
        kind = ev["event"]
        if kind == "collected":
            proc.collected = ev["ids"]
        elif kind == "collect_error":
            proc.outcomes[ev["id"]] = "error"
            proc.messages[ev["id"]] = "collection failed: " + ev["message"]
        elif kind == "collect_skip":
            proc.outcomes[ev["id"]] = "skipped"
            proc.messages[ev["id"]] = ev["message"]
        elif kind == "start":
            proc.running = ev["id"]
            reports[ev["id"]] = []
        elif kind == "report":
            reports.setdefault(ev["id"], []).append(ev)
            if ev["message"]:
                proc.messages.setdefault(ev["id"], f"{ev['when']}: {ev['message']}")
        elif kind == "finish":
            proc.running = None
            proc.outcomes[ev["id"]] = _outcome(reports.get(ev["id"], []))
        elif kind == "results":
            proc.results[ev["id"]] = list(ev["lines"])
        elif kind == "poisoned":
            proc.poisoned = ev["id"]
        elif kind == "end":
            proc.ended = True
            proc.exitstatus = ev["exitstatus"]
    return proc
