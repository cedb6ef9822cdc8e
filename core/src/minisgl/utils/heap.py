"""The garbage collector in a long-running server process: start-up's objects frozen, long pauses reported."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("minisgl.server")


def settle_heap() -> None:
    """Start-up is over: collect once, then freeze every object alive (modules, the model, the tokenizer) out of
    the collector's reach. A full collection otherwise walks all of them, some 300,000 objects in a process that
    imported torch and transformers: a pause of 100-300 ms in which the process serves nothing."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def loading_quietly() -> Iterator[None]:
    """Load something big (a tokenizer, with transformers) in a process that may already be serving: no collection
    runs meanwhile (a full one would pause every thread of the process). In a process that has settled its heap,
    what loading made is frozen too; any other process (a test's, a notebook's) keeps its collector as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count():
            gc.freeze()
        if enabled:
            gc.enable()


def watch_gc_pauses(process: str, threshold: float = 0.05) -> Any:
    """Log a warning whenever a full collection pauses this process for more than ``threshold`` seconds.
    Returns the callback (``gc.callbacks.remove`` takes it off)."""
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        elif (paused := time.perf_counter() - started[0]) > threshold:
            logger.warning(
                "%s: a full garbage collection paused the process for %.0f ms (%d objects are frozen)",
                process,
                paused * 1000,
                gc.get_freeze_count(),
            )

    gc.callbacks.append(callback)
    return callback
