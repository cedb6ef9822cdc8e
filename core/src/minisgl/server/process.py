"""What every worker process shares: launch arguments, start-up reporting, parent watch.

Workers are started with the ``spawn`` method and receive one msgpack-encoded
dict of plain values. They report "ready" or "error" (with the message a user
should see) to the launcher's status socket, ignore SIGINT (Ctrl-C reaches the
whole process group; the launcher decides what happens), and exit on their own
when the launcher process disappears, so no worker outlives the server.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

from ..message import WorkerStatus, encode


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


class StatusReporter:
    """Sends :class:`WorkerStatus` messages to the launcher."""

    def __init__(self, ctx: zmq.Context, address: str, worker: str):
        self.worker = worker
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)

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
        ctx.destroy(linger=2000)
    if code:
        sys.exit(code)
