"""Starting, watching and stopping the server's processes.

This process runs the API server (FastAPI + uvicorn); over ZMQ it talks to the tokenizer workers and the
detokenizer, which talk to the scheduler (rank 0, which starts ranks 1..tp-1 as its children). IPC sockets live
in a private temporary directory; a worker's start-up error is raised as :class:`StartupError` with its message.
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
from uvicorn import Config, Server

from ..message import Heartbeat, WorkerStatus, decode, encode
from ..utils.heap import settle_heap, watch_gc_pauses
from .settings import ServeSettings

logger = logging.getLogger("minisgl.server")


class StartupError(RuntimeError):
    """A worker failed to start; the message is the worker's own error."""


@dataclass
class Health:
    """What the workers' heartbeats say: ``problem`` is None when every worker is alive and making progress."""

    problem: str | None
    scheduler: dict[str, Any]


class Launcher:
    """Owns the socket directory and the worker processes, and follows their heartbeats."""

    def __init__(self, settings: ServeSettings, plugins: list[str]):
        self.settings = settings
        self.plugins = plugins
        self.socket_dir = make_socket_dir()
        count = settings.tokenizer_workers or max(1, min(4, (os.cpu_count() or 2) // 4))
        self.tokenizers = [f"tokenizer-{i}" for i in range(count)]
        self.addresses = {
            name: f"ipc://{os.path.join(self.socket_dir, name)}.sock"
            for name in ("api", *self.tokenizers, "detokenizer", "scheduler", "status")
        }
        self.workers: dict[str, Any] = {}  # name -> multiprocessing.Process (spawn context)
        self._ctx = zmq.Context()
        self._status = self._ctx.socket(zmq.PULL)
        self._status.bind(self.addresses["status"])
        self.info: dict[str, Any] = {}
        self.failure: str | None = None
        self._beats: dict[str, tuple[float, Heartbeat | None]] = {}  # worker -> (when, last heartbeat)

    def start(self) -> dict[str, Any]:
        """Spawn every worker (never forked: CUDA and threads do not survive a fork) and wait until all are ready;
        the scheduler's model info."""
        from .workers import detokenizer_main, scheduler_main, tokenizer_main

        ctx = mp.get_context("spawn")
        model = self.settings.model
        engine = {**self.settings.engine_fields(), "plugins": self.plugins}
        spawns: list[tuple[str, Any, dict[str, Any]]] = [("scheduler-0", scheduler_main, {"engine": engine})]
        spawns += [(name, tokenizer_main, {"model": model}) for name in self.tokenizers]
        spawns.append(("detokenizer", detokenizer_main, {"model": model}))
        for name, target, args in spawns:
            launch = encode({"addresses": self.addresses, "name": name, **args})
            self.workers[name] = ctx.Process(target=target, args=(launch,), name=f"minisgl-{name}", daemon=False)
            self.workers[name].start()
        logger.info("workers: %s", ", ".join(f"{name} pid={p.pid}" for name, p in self.workers.items()))
        pending = set(self.workers)
        while pending:
            msg = self._next_status(0.2)
            dead = self.dead_worker() if msg is None else None
            if dead is not None:
                msg = self._next_status(1.0)  # its error report may still be in flight: give it a moment
            if isinstance(msg, WorkerStatus) and msg.state == "error":
                logger.debug("%s failed:\n%s", msg.worker, msg.detail)
                raise StartupError(f"{msg.worker} process failed to start: {msg.error}")
            if dead is not None:
                raise StartupError(dead)
            if isinstance(msg, WorkerStatus):
                pending.discard(msg.worker)
                self._beats[msg.worker] = (time.monotonic(), None)
                if msg.worker == "scheduler-0":
                    self.info = msg.info
        return self.info

    def _next_status(self, timeout: float) -> WorkerStatus | Heartbeat | None:
        if not self._status.poll(int(timeout * 1000)):
            return None
        msg = decode(self._status.recv())
        if isinstance(msg, Heartbeat):
            self._beats[msg.worker] = (time.monotonic(), msg)  # for health()
        return msg

    def dead_worker(self) -> str | None:
        """A description of the first worker that has exited, if any."""
        for name, proc in self.workers.items():
            code = proc.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"the {name} process {how}"
        return None

    def check(self) -> str | None:
        """Why the server can no longer serve (a worker died or reported a fatal error), or None; also takes in
        every heartbeat that arrived since the last call."""
        while (msg := self._next_status(0)) is not None:
            if self.failure is None and isinstance(msg, WorkerStatus) and msg.state == "error":
                self.failure = f"the {msg.worker} process failed: {msg.error}"
        if self.failure is None:
            self.failure = self.dead_worker()
        return self.failure

    def health(self, silence: float, stall: float) -> Health:
        """Whether every worker sent a heartbeat within ``silence`` seconds and no step has run ``stall`` seconds."""
        now = time.monotonic()
        scheduler: dict[str, Any] = {}
        problem = self.check()
        for name, (when, beat) in self._beats.items():
            quiet = now - when
            if problem is None and quiet > silence:
                problem = f"the {name} process has not reported for {quiet:.1f} s (stopped or hung)"
            if name == "scheduler-0" and beat is not None:
                scheduler = beat.state
                if problem is None and beat.busy_for > stall:
                    problem = f"the engine has been inside one step for {beat.busy_for:.0f} s (stalled)"
        return Health(problem, scheduler)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL) and remove the socket directory."""
        for proc in self.workers.values():
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for name, proc in self.workers.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.warning("%s did not exit after SIGTERM; killing it", name)
                proc.kill()
                proc.join(2.0)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _identity(pid: int) -> str | None:
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
    return None if fields[0] in ("Z", "X") else f"{pid} {fields[19]}"


def make_socket_dir() -> str:
    """A new private directory for this server's IPC sockets; first removes those of servers that are gone.

    Each holds a ``pid`` file (pid and start time), since a server killed with SIGKILL cannot remove its own. One whose
    server no longer runs (no such process, a zombie, or its pid reused) is removed; any other is left alone.
    """
    for old in Path(tempfile.gettempdir()).glob("minisgl-*"):
        try:
            if old.stat().st_uid != os.getuid() or not old.is_dir():
                continue
            pid, _, start = (old / "pid").read_text().strip().partition(" ")
        except OSError:
            continue
        if not pid.isdigit():
            continue
        current = _identity(int(pid))
        if current is None or (start not in ("", "?") and current != f"{pid} {start}"):
            logger.info("removing %s, left behind by server process %s (no longer running)", old, pid)
            shutil.rmtree(old, ignore_errors=True)
    path = tempfile.mkdtemp(prefix="minisgl-")
    Path(path, "pid").write_text((_identity(os.getpid()) or f"{os.getpid()} ?") + "\n")
    return path


def check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


class _DrainingServer(Server):
    """uvicorn's server, with the first SIGINT/SIGTERM starting the app's drain: uvicorn stops listening and waits
    for open requests, which the app lets run for ``--shutdown-timeout`` seconds before it ends the rest."""

    def __init__(self, config: Config, app: Any):
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        begin = getattr(self.app.state, "begin_drain", None)
        if not self.should_exit and begin is not None:
            begin()  # thread-safe: this runs in a signal handler
        super().handle_exit(sig, frame)


def serve(settings: ServeSettings, plugins: list[str]) -> int:
    """Run the server until SIGINT/SIGTERM (exit 0) or a worker failure (exit 1)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_port(settings.host, settings.port)
    if problem is not None:
        print(f"minisgl serve: error: {problem}; pick another --port", file=sys.stderr)
        return 2
    # Outside uvicorn (which handles both itself), SIGTERM raises KeyboardInterrupt, as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    launcher = Launcher(settings, plugins)
    try:
        logger.info("loading %s", settings.model)
        info = launcher.start()
        logger.info("model ready: %s", ", ".join(f"{k}={v}" for k, v in info.items()))
        from .app import create_app

        app = create_app(settings, launcher.addresses, info, launcher)
        settle_heap()
        watch_gc_pauses("api server")
        # The timeout is a backstop only: the app itself ends what is left when the grace period is over.
        graceful = max(1, int(settings.shutdown_timeout) + 5)
        config = Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            timeout_graceful_shutdown=graceful,
        )
        app.state.server = server = _DrainingServer(config, app)
        server.run()
        return int(app.state.exit_code)
    except StartupError as exc:
        print(f"minisgl serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # A second signal must not interrupt the clean-up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.shutdown()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
