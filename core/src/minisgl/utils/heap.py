"""The garbage collector in a long-running server process: start-up's objects frozen, long pauses reported."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger("minisgl.server")


def settle_heap(collect: bool = True) -> None:
    """Start-up is over: collect once (unless ``collect`` is False), then freeze every object alive (modules,
    the model, the tokenizer) out of the collector's reach. A full collection otherwise walks all of them, some
    300,000 objects in a process that imported torch and transformers: a pause of 100-300 ms in which the
    process serves nothing."""
    if collect:
        gc.collect()
    gc.freeze()


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
