"""Tensor parallelism at the scheduler: every rank runs the same batches in the same order.

Rank 0 owns the request stream. Before each step it broadcasts, as one msgpack
message, every request added and aborted since the last step, then "step".
Every other rank replays exactly those calls on its own :class:`Scheduler`, so
admission, chunking, batch order, page allocation and sampling (same seeds,
same generator draws, logits all-gathered to every rank) are identical
everywhere, and the model's collectives line up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from ..core import Req, SamplingParams
from ..distributed.group import ControlChannel
from ..engine import Engine
from .scheduler import Scheduler, TokenEvent

logger = logging.getLogger(__name__)


class ReplicatedScheduler(Scheduler):
    """Rank 0's scheduler: a :class:`Scheduler` whose calls are mirrored to the other ranks."""

    def __init__(self, engine: Engine, *, control: ControlChannel, **kwargs: Any):
        super().__init__(engine, **kwargs)
        self.control = control
        self._pending: list[list[Any]] = []
        self._stopped = False

    def add_request(self, input_ids: Sequence[int], params: SamplingParams, rid: int | None = None) -> Req:
        req = super().add_request(input_ids, params, rid)  # validation errors stop here, unmirrored
        self._pending.append(["add", req.rid, req.input_ids, params.to_dict()])
        return req

    def abort(self, rid: int, reason: str = "abort") -> Req | None:
        req = super().abort(rid, reason)
        if req is not None:
            self._pending.append(["abort", rid])
        return req

    def step(self) -> list[TokenEvent]:
        self._pending.append(["step"])
        self.control.broadcast(msgpack.packb(self._pending))
        self._pending = []
        return super().step()

    def stop(self) -> None:
        """Tell the other ranks to leave their loops (pending adds/aborts go first)."""
        if not self._stopped:
            self._stopped = True
            self.control.broadcast(msgpack.packb([*self._pending, ["stop"]]))
            self._pending = []


def follow(scheduler: Scheduler, control: ControlChannel) -> None:
    """A non-zero rank's loop: replay rank 0's calls until it says stop."""
    while True:
        for msg in msgpack.unpackb(control.broadcast(), strict_map_key=False):
            kind = msg[0]
            if kind == "add":
                scheduler.add_request(msg[2], SamplingParams.from_dict(msg[3]), rid=msg[1])
            elif kind == "abort":
                scheduler.abort(msg[1])
            elif kind == "step":
                scheduler.step()
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown control message {kind!r} from rank 0")


def exit_with_parent(poll_seconds: float = 1.0) -> None:
    """End this process when the process that started it is gone (no orphaned ranks)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != parent:
                logger.error("parent process %d is gone; tensor-parallel rank exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
