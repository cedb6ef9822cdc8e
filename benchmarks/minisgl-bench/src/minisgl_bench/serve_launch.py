"""``minisgl bench serve --launch CMD``: start the server under test, wait until it answers, stop it after.

One command then measures one server from start to finish, which is what a
side-by-side run on a lent machine needs (each server started, measured and
stopped in turn, never both at once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> float:
    """Poll ``GET url/v1/models`` until it answers 200; seconds waited. Fails if the process exits first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the launched server exited with {proc.returncode} before it was ready:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or still starting
        time.sleep(1.0)
    raise SystemExit(f"the launched server did not answer {url}/v1/models within {timeout:g} s:\n{_tail(log)}")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop the benchmark; while a server it launched runs, they stop that server first."""


class _StopOnSignal:
    """Turns the stop signals into ``SystemExit(128 + signal)`` for the length of a ``with`` block.

    The exception unwinds the benchmark (the event loop included) through the ``finally`` that stops
    the launched server. A signal that comes while the server is being stopped does not interrupt
    that: it sets ``hurry``, and the stop sends SIGKILL at once instead of waiting out its grace.
    Outside the main thread (where Python cannot set handlers) it does nothing.
    """

    def __init__(self, action: str = "stopping the launched server") -> None:
        self.action = action  # what the message says happens next
        self.stopping = False
        self.hurry = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            self.hurry = True
            return
        self.stopping = True
        name = signal.Signals(signum).name
        print(f"{name}: {self.action}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stop_on_signal() -> Iterator[None]:
    """The stop signals raise ``SystemExit(128 + signal)`` inside the block (a benchmark without a launched
    server: it ends early, as with one)."""
    with _StopOnSignal("stopping"):
        yield


@contextlib.contextmanager
def launched(command: str, url: str, timeout: float = 600.0, grace: float = 60.0) -> Iterator[dict[str, object]]:
    """Run shell ``command`` in its own session (output to a log file) until the block ends.

    However the block ends (normally, by an exception, or by SIGTERM, SIGINT or SIGHUP of this
    process, which raise ``SystemExit(128 + signal)``), the server's whole process group is stopped:
    SIGTERM, then SIGKILL after ``grace`` seconds. Yields what the JSON record keeps about it: the
    command, the start-up seconds and the log path.
    """
    log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
    with _StopOnSignal() as guard:
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, shell=True, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            print(f"launched (pid {proc.pid}, log {log}): {command}", file=sys.stderr, flush=True)
            info: dict[str, object] = {"command": command, "log": str(log)}
            info["startup_s"] = wait_ready(url, proc, log, timeout)
            print(f"ready after {info['startup_s']:.1f} s", file=sys.stderr, flush=True)
            yield info
        finally:
            guard.stopping = True
            stop_group(proc, grace, lambda: guard.hurry)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[bytes], grace: float = 60.0, hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM to the server's process group (the shell and all it started); SIGKILL what is left after ``grace`` s.

    ``hurry()`` true cuts the grace short. The whole group must be gone before the next server
    starts: a worker left behind keeps its GPU memory.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        proc.poll()  # reap the shell, so that it does not count as alive
        if not _group_alive(proc.pid):
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
