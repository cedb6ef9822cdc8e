"""Worker processes: one stopped by the launcher's SIGTERM exits normally, so its finalizers run (no leaked
semaphore); one that reports ready has frozen its start-up objects out of the garbage collector's reach."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from minisgl.message import WorkerStatus, decode, encode
from minisgl.server.workers import worker_process


def _body(launch: bytes, ready_file: str) -> None:
    with worker_process(launch) as (_args, _ctx, _status):
        lock = mp.get_context("spawn").Lock()  # a named semaphore, unlinked by a finalizer at a normal exit
        Path(ready_file).write_text(str(os.getpid()))
        while True:
            with lock:
                time.sleep(0.05)


@contextlib.contextmanager
def _worker(tmp_path: Path, name: str, body: Callable[..., None], *args: Any) -> Iterator[tuple[Any, zmq.Socket]]:
    """Spawn ``body(launch, *args)`` as worker ``name``; yields the process and the launcher's status socket."""
    ctx = zmq.Context()
    status = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path / 'status.sock'}"
    status.bind(address)
    launch = encode({"addresses": {"status": address}, "name": name})
    proc = mp.get_context("spawn").Process(target=body, args=(launch, *args))
    proc.start()
    try:
        yield proc, status
    finally:
        if proc.is_alive():
            proc.kill()
        status.close(linger=0)
        ctx.term()


def test_sigterm_ends_a_worker_cleanly(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    with _worker(tmp_path, "tokenizer-0", _body, str(ready)) as (proc, status):
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
        # Killed by the default handler it would read -15, and its lock's semaphore would outlive it.
        assert proc.exitcode == 0
        reports = []
        while status.poll(100):
            reports.append(decode(status.recv()))
        assert not [r for r in reports if isinstance(r, WorkerStatus) and r.state == "error"]


def _ready_body(launch: bytes, out_file: str) -> None:
    with worker_process(launch) as (_args, _ctx, status):
        before = gc.get_freeze_count()
        status.ready()
        Path(out_file).write_text(f"{before} {gc.get_freeze_count()}")


def test_ready_freezes_the_start_up_heap(tmp_path: Path) -> None:
    """A full collection in a busy worker would otherwise walk every object start-up made (100-300 ms)."""
    out = tmp_path / "freeze"
    with _worker(tmp_path, "detokenizer", _ready_body, str(out)) as (proc, status):
        proc.join(60)
        assert proc.exitcode == 0
        before, after = map(int, out.read_text().split())
        assert before == 0 and after > 1000  # the modules it imported, at least
        assert status.poll(1000)
        report = decode(status.recv())
        assert isinstance(report, WorkerStatus) and report.state == "ready"
