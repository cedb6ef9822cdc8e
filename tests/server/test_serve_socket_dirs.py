"""Socket directories ($TMPDIR/minisgl-*): each records its server, and a server removes those of dead ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from serverutil import Server, alive, descendants

from minisgl.server.launcher import make_socket_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _fake_dir(base: Path, name: str, pid_file: str | None) -> Path:
    path = base / name
    path.mkdir()
    (path / "scheduler.sock").write_text("")
    if pid_file is not None:
        (path / "pid").write_text(pid_file + "\n")
    return path


def test_only_directories_of_servers_that_are_gone_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    me = os.getpid()
    dead = _fake_dir(tmp_path, "minisgl-dead", f"{_dead_pid()} 12345")
    reused = _fake_dir(tmp_path, "minisgl-reused", f"{me} {int(_start_time(me)) + 1}")  # same pid, another process
    live = _fake_dir(tmp_path, "minisgl-live", f"{me} {_start_time(me)}")
    live_pid_only = _fake_dir(tmp_path, "minisgl-live-pid-only", f"{me}")
    unknown = _fake_dir(tmp_path, "minisgl-nopid", None)  # not ours to judge: kept
    other = _fake_dir(tmp_path, "other-dead", f"{_dead_pid()} 1")

    new = Path(make_socket_dir())

    assert not dead.exists() and not reused.exists()
    assert live.exists() and live_pid_only.exists() and unknown.exists() and other.exists()
    assert new.parent == tmp_path and new.name.startswith("minisgl-")
    assert (new / "pid").read_text().split() == [str(me), _start_time(me)]
    assert oct(new.stat().st_mode & 0o777) == oct(0o700)


def _socket_dirs(tmpdir: Path) -> dict[str, int]:
    return {p.name: int((p / "pid").read_text().split()[0]) for p in tmpdir.glob("minisgl-*") if (p / "pid").exists()}


def test_a_new_server_removes_a_killed_servers_directory_and_keeps_a_live_ones(
    tiny_model: Path, tmp_path: Path
) -> None:
    args = ("--num-pages", "64", "--max-model-len", "128", "--cache", "naive")
    shared_tmpdir = tmp_path / "tmp"  # Server() uses tmp_path / "tmp" as TMPDIR: all three share it
    shared_tmpdir.mkdir()
    stale = _fake_dir(shared_tmpdir, "minisgl-stale", f"{_dead_pid()} 1")
    first, second = Server(tiny_model, tmp_path, *args), Server(tiny_model, tmp_path, *args)
    third = None
    try:
        first.wait_ready()
        second.wait_ready()
        assert not stale.exists()
        dirs = _socket_dirs(shared_tmpdir)
        assert sorted(dirs.values()) == sorted([first.proc.pid, second.proc.pid])  # neither removed the other's

        workers = descendants(first.proc.pid)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in workers), "the killed server's workers outlived it"
        assert first.proc.pid in _socket_dirs(shared_tmpdir).values()  # SIGKILL: nothing removed it

        third = Server(tiny_model, tmp_path, *args).wait_ready()
        assert sorted(_socket_dirs(shared_tmpdir).values()) == sorted([second.proc.pid, third.proc.pid])
        assert httpx.get(second.url + "/health", timeout=10).status_code == 200  # its sockets are intact
        out = httpx.post(second.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
    finally:
        for server in (first, second, third):
            if server is not None:
                server.stop()
    assert _socket_dirs(shared_tmpdir) == {}  # a clean stop removes its own
