"""The server processes' garbage-collector helpers: start-up's objects frozen, long full collections reported."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys

import pytest

from minisgl.utils.heap import watch_gc_pauses


def test_settle_heap_freezes_what_is_alive_and_later_garbage_is_still_collected() -> None:
    # In a process of its own: frozen objects would stay frozen in this one.
    code = """
import gc, weakref
from minisgl.utils.heap import settle_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

garbage = cycle()  # unreachable already: the collection before the freeze frees it
kept = [Node() for _ in range(1000)]
assert gc.get_freeze_count() == 0
settle_heap()
assert garbage() is None, "the start-up collection did not run"
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
later = cycle()
gc.collect()
assert later() is None, "a cycle made after the freeze was not collected"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_a_long_full_collection_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    callback = watch_gc_pauses("scheduler-0", threshold=0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="minisgl.server"):
            gc.collect(1)  # a young collection is never reported
            assert not caplog.records
            gc.collect()
        assert len(caplog.records) == 1
        assert caplog.records[0].getMessage().startswith("scheduler-0: a full garbage collection paused the process")
    finally:
        gc.callbacks.remove(callback)


def test_a_short_full_collection_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    callback = watch_gc_pauses("api server", threshold=60.0)
    try:
        with caplog.at_level(logging.WARNING, logger="minisgl.server"):
            gc.collect()
        assert not caplog.records
    finally:
        gc.callbacks.remove(callback)


def test_loading_quietly_runs_no_collection_and_freezes_only_in_a_settled_process() -> None:
    code = """
import gc
from minisgl.utils.heap import loading_quietly, settle_heap

collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
with loading_quietly():  # in a process that has not settled its heap: nothing is frozen
    assert not gc.isenabled()
    seen = len(collections)
    made = [[i] for i in range(100_000)]  # enough allocations to trigger many collections
    assert len(collections) == seen
assert gc.isenabled()
assert gc.get_freeze_count() == 0
settle_heap()
frozen = gc.get_freeze_count()
with loading_quietly():  # in a server process, after start-up: what the load makes is frozen too
    seen = len(collections)
    more = [[i] for i in range(100_000)]
    assert len(collections) == seen
assert gc.get_freeze_count() >= frozen + 100_000
try:
    with loading_quietly():
        raise ValueError("the load failed")
except ValueError:
    pass
assert gc.isenabled()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
