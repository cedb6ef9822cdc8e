"""Starting, watching and stopping the server's processes.

::

    this process: API server (FastAPI + uvicorn)  <-ZMQ->  tokenizer/detokenizer  <-ZMQ->  scheduler (rank 0)
                                                                                      `- ranks 1..tp-1 (its children)

Workers are spawned (never forked: CUDA and threads do not survive a fork),
each given a msgpack-encoded argument dict with the plugin names this process
resolved. IPC sockets live in a private temporary directory removed at exit.
The launcher waits until every worker reports "ready"; a worker's start-up
error (bad model, unknown architecture, out of memory) is raised as
:class:`StartupError` with that worker's message.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from ..message import WorkerStatus, decode
from .process import pack_args
from .settings import ServeSettings

logger = logging.getLogger("minisgl.server")


class StartupError(RuntimeError):
    """A worker failed to start; the message is the worker's own error."""


class Terminated(Exception):
    """SIGTERM arrived while the launcher was not inside uvicorn."""


@dataclass
class Worker:
    name: str
    process: Any  # multiprocessing.Process (spawn context)


class Launcher:
    """Owns the socket directory and the worker processes."""

    def __init__(self, settings: ServeSettings, plugins: list[str]):
        self.settings = settings
        self.plugins = plugins
        self.socket_dir = make_socket_dir()
        self.addresses = {
            name: f"ipc://{os.path.join(self.socket_dir, name)}.sock"
            for name in ("api", "tokenizer", "detokenizer", "scheduler", "status")
        }
        self.workers: list[Worker] = []
        self._ctx = zmq.Context()
        self._status = self._ctx.socket(zmq.PULL)
        self._status.bind(self.addresses["status"])
        self.info: dict[str, Any] = {}
        self.failure: str | None = None

    def start(self) -> dict[str, Any]:
        """Spawn every worker and wait until all are ready; the scheduler's model info."""
        from ..tokenizer.worker import tokenizer_main
        from .scheduler_worker import scheduler_main

        ctx = mp.get_context("spawn")
        engine = {**self.settings.engine_fields(), "plugins": self.plugins}
        # Rank 0 starts the other tensor-parallel ranks itself and owns them (they follow its every step).
        self._spawn(ctx, "scheduler-0", scheduler_main, {"addresses": self.addresses, "engine": engine, "rank": 0})
        self._spawn(ctx, "tokenizer", tokenizer_main, {"addresses": self.addresses, "model": self.settings.model})
        logger.info("workers: %s", ", ".join(f"{w.name} pid={w.process.pid}" for w in self.workers))
        pending = {w.name for w in self.workers}
        while pending:
            status = self._next_status(0.2)
            if status is not None:
                if status.state == "error":
                    logger.debug("%s failed:\n%s", status.worker, status.detail)
                    raise StartupError(f"{status.worker} process failed to start: {status.error}")
                pending.discard(status.worker)
                if status.worker == "scheduler-0":
                    self.info = status.info
                continue
            dead = self.dead_worker()
            if dead is not None:
                # Its error report may still be in flight: give it a moment.
                status = self._next_status(1.0)
                if status is not None and status.state == "error":
                    raise StartupError(f"{status.worker} process failed to start: {status.error}")
                raise StartupError(dead)
        return self.info

    def _spawn(self, ctx: Any, name: str, target: Any, args: dict[str, Any]) -> None:
        proc = ctx.Process(target=target, args=(pack_args(args),), name=f"minisgl-{name}", daemon=False)
        proc.start()
        self.workers.append(Worker(name, proc))

    def _next_status(self, timeout: float) -> WorkerStatus | None:
        if self._status.poll(int(timeout * 1000)):
            msg = decode(self._status.recv())
            if isinstance(msg, WorkerStatus):
                return msg
        return None

    def dead_worker(self) -> str | None:
        """A description of the first worker that has exited, if any."""
        for w in self.workers:
            code = w.process.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"the {w.name} process {how}"
        return None

    def check(self) -> str | None:
        """Why the server can no longer serve (a worker died or reported a fatal error), or None."""
        if self.failure is None:
            status = self._next_status(0)
            if status is not None and status.state == "error":
                self.failure = f"the {status.worker} process failed: {status.error}"
            else:
                self.failure = self.dead_worker()
        return self.failure

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL) and remove the socket directory."""
        for w in self.workers:
            if w.process.exitcode is None:
                w.process.terminate()
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.exitcode is None:
                logger.warning("%s did not exit after SIGTERM; killing it", w.name)
                w.process.kill()
                w.process.join(2.0)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def make_socket_dir() -> str:
    """A new private directory for this server's IPC sockets; first removes those of servers that are gone.

    A server killed with SIGKILL cannot remove its directory, so each one holds a ``pid`` file: the
    pid and start time of the server that made it. A directory whose server no longer runs (no such
    process, a zombie, or the pid now belongs to a process started at another time) is removed.
    Directories of running servers, of other users, or without a ``pid`` file are left alone.
    """

    def identity(pid: int) -> str | None:
        """``"PID START"`` of a running process, or None when there is none (or only a zombie)."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            if sys.platform.startswith("linux"):
                return None
            try:  # no /proc: the pid alone
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return f"{pid} ?"
        return None if fields[0] in "ZX" else f"{pid} {fields[19]}"

    for old in Path(tempfile.gettempdir()).glob("minisgl-*"):
        try:
            if old.stat().st_uid != os.getuid() or not old.is_dir():
                continue
            recorded = (old / "pid").read_text().strip()
        except OSError:
            continue
        pid, _, start = recorded.partition(" ")
        if not pid.isdigit():
            continue
        current = identity(int(pid))
        if current is None or (start != "?" and current != f"{pid} {start}"):
            logger.info("removing %s, left behind by server process %s (no longer running)", old, pid)
            shutil.rmtree(old, ignore_errors=True)
    path = tempfile.mkdtemp(prefix="minisgl-")
    Path(path, "pid").write_text((identity(os.getpid()) or f"{os.getpid()} ?") + "\n")
    return path


def check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def serve(settings: ServeSettings, plugins: list[str]) -> int:
    """Run the server until SIGINT/SIGTERM (exit 0) or a worker failure (exit 1)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_port(settings.host, settings.port)
    if problem is not None:
        print(f"minisgl serve: error: {problem}; pick another --port", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    launcher = Launcher(settings, plugins)
    try:
        logger.info("loading %s", settings.model)
        info = launcher.start()
        logger.info("model ready: %s", info)
        import uvicorn

        from .app import create_app

        app = create_app(settings, launcher.addresses, info, launcher.check)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)),
        )
        server = uvicorn.Server(config)
        app.state.server = server
        server.run()
        return int(app.state.exit_code)
    except StartupError as exc:
        print(f"minisgl serve: error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated):
        return 0
    finally:
        # A second signal must not interrupt the clean-up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.shutdown()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
