"""What every worker process shares: launch arguments, start-up reporting, parent watch.

Workers are started with the ``spawn`` method and receive one msgpack-encoded
dict of plain values. They report "ready" or "error" (with the message a user
should see) to the launcher's status socket, ignore SIGINT (Ctrl-C reaches the
whole process group; the launcher decides what happens), and exit on their own
when the launcher process disappears, so no worker outlives the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

from ..message import Heartbeat, WorkerStatus, encode, recv_all

# Seconds between two heartbeats of a worker (see StatusReporter.start_heartbeat).
HEARTBEAT_S = 0.5

Probe = Callable[[], tuple[float, dict[str, Any]]]


def pack_args(args: dict[str, Any]) -> bytes:
    return msgpack.packb(args, use_bin_type=True)


def unpack_args(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)


def user_error(exc: BaseException) -> str:
    """The one-line message to show for a start-up failure."""
    from ..core import ValidationError

    if isinstance(exc, ValidationError):
        return f"invalid {exc.field}: {exc.message}"
    text = str(exc) or type(exc).__name__
    # Errors meant for users carry their own wording; anything else gets its type for context.
    names = ("ModelLoadError", "UnknownComponentError", "PluginError")
    if type(exc).__name__ in names:
        return text
    lowered = text.lower()
    if isinstance(exc, MemoryError) or any(s in lowered for s in ("out of memory", "not enough memory", "allocate")):
        return f"out of memory: {text}"
    return f"{type(exc).__name__}: {text}"


class ParentWatch:
    """Notices that the launcher died (the worker was re-parented)."""

    def __init__(self, interval: float = 0.5):
        self.parent = os.getppid()
        self.interval = interval
        self._next = time.monotonic() + interval

    def due(self) -> bool:
        """True once per ``interval``: time for the (cheap but not free) liveness checks."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval
        return True

    def parent_gone(self) -> bool:
        return os.getppid() != self.parent


def serve_inbox(inbox: zmq.Socket, handle: Callable[[Any], None]) -> None:
    """A worker's loop: hand every message arriving on ``inbox`` to ``handle`` until the launcher is gone."""
    watch = ParentWatch()
    while not (watch.due() and watch.parent_gone()):
        if inbox.poll(200):
            for msg in recv_all(inbox):
                handle(msg)


class StatusReporter:
    """Sends :class:`WorkerStatus` messages and heartbeats to the launcher."""

    def __init__(self, ctx: zmq.Context, address: str, worker: str):
        self.worker = worker
        self.ctx = ctx
        self.address = address
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beat: threading.Thread | None = None

    def start_heartbeat(self, probe: Probe | None = None, interval: float = HEARTBEAT_S) -> None:
        """Send a :class:`Heartbeat` every ``interval`` seconds from a thread of its own.

        The thread runs while the main thread is inside a long computation (kernels release the
        GIL), and stops with the process, so a stopped or dead worker falls silent.
        ``probe`` returns ``(busy_for, state)``: how long the current unit of work has run, and gauges.
        """

        def run() -> None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            try:
                while not self._stop.is_set():
                    self._wake.wait(interval)
                    self._wake.clear()
                    if self._stop.is_set():
                        break
                    busy, state = probe() if probe is not None else (0.0, {})
                    with contextlib.suppress(zmq.Again):  # the launcher is not reading: skip this beat
                        sock.send(encode(Heartbeat(self.worker, busy, state)), zmq.NOBLOCK)
            except zmq.ZMQError:  # the context is going away with the process
                pass
            finally:
                sock.close(0)

        self._beat = threading.Thread(target=run, name=f"{self.worker}-heartbeat", daemon=True)
        self._beat.start()

    def beat_now(self) -> None:
        """Send the next heartbeat at once (the state just changed in a way watchers care about)."""
        self._wake.set()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._beat is not None:
            self._beat.join(2.0)

    def ready(self, **info: Any) -> None:
        self.sock.send(encode(WorkerStatus(self.worker, "ready", info=info)))

    def error(self, exc: BaseException) -> None:
        detail = "".join(traceback.format_exception(exc))
        self.sock.send(encode(WorkerStatus(self.worker, "error", error=user_error(exc), detail=detail)))


@contextmanager
def worker_process(worker: str, status_address: str) -> Iterator[tuple[zmq.Context, StatusReporter]]:
    """Run a worker's body: report an exception to the launcher and exit non-zero."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    reporter = StatusReporter(ctx, status_address, worker)
    code = 0
    try:
        yield ctx, reporter
    except BaseException as exc:  # every failure must reach the launcher, whatever its type
        code = 1
        try:
            reporter.error(exc)
        finally:
            traceback.print_exc(file=sys.stderr)
    finally:
        reporter.stop_heartbeat()
        ctx.destroy(linger=2000)
    if code:
        sys.exit(code)
