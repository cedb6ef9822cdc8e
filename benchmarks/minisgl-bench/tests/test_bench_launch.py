"""``minisgl bench serve --launch``: the launched server and everything it started are gone however the benchmark ends.

A stand-in server (a small script written here) starts a child process and then either never
answers (a server still starting) or answers ``/v1/models`` and holds every completion request
open (a server under load). The benchmark runs in its own process and gets a stop signal; the
test then checks that the server and its child are gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from minisgl_bench.serve_launch import stop_group

SERVER = r"""
import http.server, json, os, subprocess, sys, time
pidfile, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
os.replace(pidfile + ".tmp", pidfile)
if mode == "silent":
    time.sleep(600)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "slow"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        open(pidfile + ".busy", "w").close()
        time.sleep(600)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (ended, not yet reaped by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the benchmark exited early ({proc.returncode}): {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.05)


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10.0
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if not _gone(p)]
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running: {left}"


@pytest.mark.parametrize(
    ("sig", "mode"),
    [
        (signal.SIGTERM, "silent"),  # still starting: the benchmark waits for /v1/models
        (signal.SIGTERM, "busy"),  # measuring: requests in flight on the event loop (loads a tokenizer: slower)
        (signal.SIGINT, "silent"),
        (signal.SIGHUP, "silent"),
    ],
)
def test_a_stop_signal_stops_the_launched_server_and_its_children(tmp_path: Path, sig: int, mode: str) -> None:
    from minisgl.testing.models import save_word_tokenizer

    script = tmp_path / "slow_server.py"
    script.write_text(SERVER)
    pidfile = tmp_path / "server.pids"
    port = _free_port()
    tokenizer = tmp_path / "tokenizer"
    if mode == "busy":
        save_word_tokenizer(tokenizer, 20_001)
    cmd = [sys.executable, "-m", "minisgl_bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    cmd += ["--launch", f"{sys.executable} {script} {pidfile} {port} {mode}", "--tokenizer", str(tokenizer)]
    cmd += ["--num-requests", "2", "--warmup", "0", "--input-len", "4", "8", "--output-len", "2", "3"]
    cmd += ["--no-progress", "--stop-grace", "10", "--output", str(tmp_path / "out")]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(pidfile, bench)
        pids = [int(p) for p in pidfile.read_text().split()]
        if mode == "busy":
            _wait_for(pidfile.with_name(pidfile.name + ".busy"), bench)
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 128 + sig, err
    assert f"{signal.Signals(sig).name}: stopping the launched server" in err
    _assert_gone(pids)
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        # The child inherits the ignored SIGTERM.
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    stop_group(proc, grace=0.5)
    assert proc.returncode == -signal.SIGKILL
    _assert_gone([proc.pid, child])


def test_hurry_cuts_the_grace_short(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    calls = []

    def hurry() -> bool:
        calls.append(1)
        return len(calls) > 2

    stop_group(proc, grace=600.0, hurry=hurry)  # would wait ten minutes without hurry
    assert proc.returncode == -signal.SIGKILL and len(calls) == 3


def test_a_stop_signal_after_a_finished_run_writes_the_finished_runs(tmp_path: Path) -> None:
    import json
    import queue
    import threading

    from minisgl.testing.models import save_word_tokenizer

    tokenizer = tmp_path / "tokenizer"
    save_word_tokenizer(tokenizer, 20_001)
    port = _free_port()
    server = f"{sys.executable} -m minisgl_bench.serve_fake --port {port} --interval 0.002"
    cmd = [sys.executable, "-m", "minisgl_bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    cmd += ["--launch", server, "--tokenizer", str(tokenizer), "--label", "cut"]
    # The all-at-once run ends in well under a second; the second one, at a request every 20 s, outlasts the test.
    cmd += ["--num-requests", "3", "--warmup", "0", "--input-len", "4", "8", "--output-len", "2", "3"]
    cmd += ["--rate", "inf", "0.05", "--no-progress", "--stop-grace", "10", "--output", str(tmp_path / "out")]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert bench.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in bench.stdout or ()], daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while True:  # the first run's row: the all-at-once run is done
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.split()[:1] == ["inf"]:
                break
        time.sleep(0.5)  # the second run has begun
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=60)
        err = bench.stderr.read() if bench.stderr else ""
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: writing the 1 finished run(s)" in err and "server log: " in err
    record = json.loads((tmp_path / "out" / "cut.json").read_text())
    assert record["interrupted"] == "SIGTERM"
    assert [r["rate"] for r in record["runs"]] == ["inf"] and record["runs"][0]["completed"] == 3
    assert [s["rate"] for s in record["summary"]] == ["inf"]
    assert not _listening(port)  # the launched server is gone


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
