"""Grammar compilation in a child process, so that one request's grammar is bounded in time and memory.

xgrammar cannot interrupt a compile, and a compile's memory is the whole process's: a pathological schema (a long
bounded repetition, deep nesting) would keep a core busy for tens of seconds and grow the scheduler by hundreds of
MiB. Here the compile runs in a process of its own (``python -m minisgl_plugin_xgrammar.compile_process``), which
is killed when it runs past the time limit or its resident memory grows past the memory limit; the next compile
starts a fresh one. The result comes back serialized (``CompiledGrammar.serialize_json``).

Frames on the pipes are an 8-byte little-endian length and a UTF-8 JSON body: the parent sends the tokenizer
info first, then one ``{"kind", "text"}`` per compile; the child answers ``{"ok": serialized}`` or
``{"error": message}`` (a grammar xgrammar refuses).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_LEN = 8


class CompileLimitError(Exception):
    """The compile ran past a limit; the message says which."""


class CompileRefused(Exception):
    """xgrammar refused the grammar (the message is its own)."""


def _frame(payload: Any) -> bytes:
    body = json.dumps(payload).encode()
    return len(body).to_bytes(_LEN, "little") + body


def _rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (Linux ``/proc``); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class CompileProcess:
    """A child process that compiles grammars for one tokenizer (its ``TokenizerInfo`` as serialized JSON).

    ``compile`` is called by one thread at a time (the scheduler's grammar thread); ``close`` from any thread."""

    start_timeout = 120.0  # importing xgrammar (and torch, transformers) in a fresh interpreter

    def __init__(self, tokenizer_info_json: str, threads: int):
        self._info = tokenizer_info_json
        self.threads = threads
        self._proc: subprocess.Popen[bytes] | None = None
        self._baseline = 0  # the child's resident memory once ready
        self._closed = False
        self.killed: list[int] = []  # pids of the children killed at a limit
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # The child must import this same package, also when it is on sys.path by hand.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "minisgl_plugin_xgrammar.compile_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            self._send(proc, {"tokenizer_info": self._info, "parent": os.getpid(), "threads": self.threads})
            ready = self._receive(proc, time.monotonic() + self.start_timeout, None)
        except BaseException:
            self._kill(proc)
            raise
        if "ready" not in ready:
            self._kill(proc)
            raise RuntimeError(f"the grammar compiler process did not start: {ready.get('error', ready)}")
        self._baseline = _rss_bytes(proc.pid) or 0
        return proc

    @staticmethod
    def _send(proc: subprocess.Popen[bytes], payload: Any) -> None:
        assert proc.stdin is not None
        proc.stdin.write(_frame(payload))
        proc.stdin.flush()

    def _receive(self, proc: subprocess.Popen[bytes], deadline: float, memory: int | None) -> dict[str, Any]:
        """One answer frame; :class:`CompileLimitError` when ``deadline`` passes or the child's memory grows
        more than ``memory`` bytes over its baseline first (the child is killed then)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = bytearray()
        while True:  # one frame is in flight at a time: nothing follows it
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill(proc)
                raise CompileLimitError("time")
            ready, _, _ = select.select([fd], [], [], min(left, 0.05))
            if memory is not None and (rss := _rss_bytes(proc.pid)) is not None and rss - self._baseline > memory:
                self._kill(proc)
                raise CompileLimitError("memory")
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                code = proc.wait()
                self._kill(proc)
                raise RuntimeError(f"the grammar compiler process exited (code {code})")
            buf += chunk
            if len(buf) >= _LEN and len(buf) >= (need := _LEN + int.from_bytes(buf[:_LEN], "little")):
                answer: dict[str, Any] = json.loads(bytes(buf[_LEN:need]))
                return answer

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        if self._proc is proc:
            self._proc = None

    def compile(self, kind: str, text: str, seconds: float, memory: int | None) -> str:
        """The serialized compiled grammar of ``(kind, text)``, within ``seconds`` and ``memory`` bytes (None:
        unbounded). :class:`CompileRefused` for a grammar xgrammar refuses, :class:`CompileLimitError` past a
        limit (the child is killed, the next call starts another)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()  # its start does not count against the limits
            proc = self._proc
            self._send(proc, {"kind": kind, "text": text})
            try:
                answer = self._receive(proc, time.monotonic() + seconds, memory)
            except CompileLimitError:
                self.killed.append(proc.pid)
                # Killed: its successor starts now, so that the next grammar does not wait for it.
                threading.Thread(target=self._restart, name="grammar-compile-start", daemon=True).start()
                raise
        if "error" in answer:
            raise CompileRefused(answer["error"])
        return str(answer["ok"])

    def _restart(self) -> None:
        with self._lock:
            if self._proc is None and not self._closed:
                with contextlib.suppress(OSError, RuntimeError):  # the next compile tries again and says why
                    self._proc = self._start()

    def close(self) -> None:
        """Kill the child now, also in the middle of a compile (that compile fails; it holds the lock until it
        sees the child gone, so the child is killed before the lock is taken)."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)


# ------------------------------------------------------------------ the child
def _read_frame(stream: Any) -> Any:
    header = stream.read(_LEN)
    if len(header) < _LEN:
        return None  # the parent closed its end
    return json.loads(stream.read(int.from_bytes(header, "little")))


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    first = _read_frame(stdin)
    if first is None:
        return
    threading.Thread(target=_watch_parent, args=(int(first["parent"]),), daemon=True).start()
    try:
        import xgrammar

        from .grammars import compile_grammar

        info = xgrammar.TokenizerInfo.deserialize_json(first["tokenizer_info"])
        compiler = xgrammar.GrammarCompiler(info, max_threads=int(first["threads"]), cache_enabled=False)
    except Exception as exc:
        stdout.write(_frame({"error": f"{type(exc).__name__}: {exc}"}))
        stdout.flush()
        return
    stdout.write(_frame({"ready": True}))
    stdout.flush()
    while (job := _read_frame(stdin)) is not None:
        try:
            answer = {"ok": compile_grammar(compiler, job["kind"], job["text"]).serialize_json()}
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError/its own errors
            answer = {"error": str(exc).strip() or type(exc).__name__}
        stdout.write(_frame(answer))
        stdout.flush()


if __name__ == "__main__":
    main()
