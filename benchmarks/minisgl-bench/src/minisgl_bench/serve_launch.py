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
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


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


@contextlib.contextmanager
def launched(command: str, url: str, timeout: float = 600.0) -> Iterator[dict[str, object]]:
    """Run shell ``command`` in its own process group (output to a log file) until the block ends.

    Yields what the JSON record keeps about it: the command, the start-up seconds and the log path.
    """
    log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, shell=True, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"launched (pid {proc.pid}, log {log}): {command}", file=sys.stderr, flush=True)
    try:
        info: dict[str, object] = {"command": command, "log": str(log)}
        info["startup_s"] = wait_ready(url, proc, log, timeout)
        yield info
    finally:
        _stop(proc)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(proc: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    """SIGTERM to the server's process group (the shell and all it started); SIGKILL what is left after ``grace`` s.

    The whole group must be gone before the next server starts: a worker left behind keeps its GPU memory.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reap the shell, so that it does not count as alive
        if not _group_alive(proc.pid):
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
