"""The step trace (``trace_steps``): one JSON line per scheduler step, the format of docs/serving.md (Step trace).

Cheap enough to leave on: host timings are ``perf_counter`` pairs; device time is a pair of CUDA events around the
launch, read with ``query()`` once the step has finished (never a synchronize on the hot path), so a line is
written a step or more after its step ran. Lines are buffered and written in batches. Stalls that happen outside a
step's own work (a garbage collection, a grammar compile, a Triton compile) are noted as they happen and reported
with the step they delayed.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

import torch

VERSION = 1
_FLUSH_EVERY = 64  # lines
_GIVE_UP_AFTER = 256  # steps whose device time is still unknown: written with gpu_ms null
_GC_REPORTED_MS = 1.0  # shorter young-generation collections are left out


@dataclass
class _Line:
    fields: dict[str, Any]
    start: Any = None  # CUDA events of the launch; None on the CPU (gpu_ms already set)
    end: Any = None
    age: int = 0


@dataclass
class StepClock:
    """What the scheduler measures of one step while it runs (all ``perf_counter`` seconds)."""

    began: float
    wall: float  # time.time() at ``began``
    waited: float = 0.0  # blocked on the device for an earlier step's tokens
    launch_began: float = 0.0
    launch_waited: float = 0.0  # ``waited`` when the launch began
    launched: float = 0.0
    events: list[str] = field(default_factory=list)


class StepTrace:
    """Writes the trace of one scheduler to ``path`` (appending); :meth:`close` flushes what is left."""

    def __init__(self, path: str, header: dict[str, Any], device: torch.device):
        self.path = path
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()
        self._cuda = device.type == "cuda"
        self._device = device
        self._pending: deque[_Line] = deque()
        self._out: list[str] = []
        self._step = 0
        self._last_began: float | None = None
        self._stalls: list[str] = []  # noted between steps, reported with the next one
        self._gc_started = 0.0
        head = {"trace": "minisgl-steps", "version": VERSION, "start": time.time(), "pid": os.getpid(), **header}
        self._file.write(json.dumps(head) + "\n")
        self._file.flush()
        gc.callbacks.append(self._on_gc)
        self._triton_hooked = self._hook_triton()

    @property
    def steps(self) -> int:
        """Step lines recorded so far."""
        return self._step

    # ------------------------------------------------------------------ noting stalls
    def note(self, event: str) -> None:
        """Report ``event`` ("name" or "name:detail") with the step that runs next (or is running)."""
        self._stalls.append(event)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_started) * 1000
        gen = info.get("generation", 0)
        if gen == 2 or ms >= _GC_REPORTED_MS:
            self._stalls.append(f"gc:gen{gen}:{ms:.1f}ms")

    def _hook_triton(self) -> bool:
        """Note each Triton kernel compile (Triton's post-compile hook, where this Triton has it and no one else
        set it). Only where Triton is already imported: the trace never imports it."""
        knobs = getattr(sys.modules.get("triton"), "knobs", None)
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or getattr(runtime, "jit_post_compile_hook", "absent") is not None:
            return False

        def compiled(*args: Any, **kwargs: Any) -> bool:
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", "kernel")
            self._stalls.append(f"triton_compile:{name}")
            return False

        runtime.jit_post_compile_hook = compiled
        return True

    # ------------------------------------------------------------------ one step
    def begin(self) -> StepClock:
        """A step begins (scheduling starts)."""
        return StepClock(time.perf_counter(), time.time())

    def gpu_events(self) -> tuple[Any, Any] | None:
        """A pair of CUDA events to record around the launch (None on the CPU)."""
        if not self._cuda:
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def record(self, clock: StepClock, fields: dict[str, Any], events: tuple[Any, Any] | None) -> None:
        """The step's line: ``fields`` (kind, requests, tokens, queue and page gauges) plus the timings."""
        gap = 0.0 if self._last_began is None else (clock.began - self._last_began) * 1000
        self._last_began = clock.began
        launch_wait = clock.waited - clock.launch_waited  # inside the launch, waiting for the previous step
        if events is None:  # the CPU runs the forward inside the launch: the host's part ends where it begins
            host = (clock.launch_began - clock.began - clock.launch_waited) * 1000
        else:
            host = (clock.launched - clock.began - clock.waited) * 1000
        stalls = clock.events + self._stalls
        self._stalls = []
        line = {
            "step": self._step,
            "t": clock.wall,
            **fields,
            "host_ms": round(host, 3),
            "gpu_ms": None,
            "gap_ms": round(gap, 3),
            "wait_ms": round(clock.waited * 1000, 3),
            "events": stalls,
        }
        self._step += 1
        if events is None:  # the CPU runs the forward inside the launch
            line["gpu_ms"] = round((clock.launched - clock.launch_began - launch_wait) * 1000, 3)
            self._pending.append(_Line(line))
        else:
            self._pending.append(_Line(line, *events))
        self._collect(force=False)

    def _collect(self, force: bool) -> None:
        """Move finished steps' lines (in step order) to the output buffer; write it every so many lines."""
        pending = self._pending
        for item in pending:
            item.age += 1
        while pending:
            item = pending[0]
            if item.end is not None:
                if item.end.query():
                    item.fields["gpu_ms"] = round(item.start.elapsed_time(item.end), 3)
                elif not force and item.age < _GIVE_UP_AFTER:
                    break
            pending.popleft()
            self._out.append(json.dumps(item.fields))
        if len(self._out) >= _FLUSH_EVERY or (force and self._out):
            self._write()

    def _write(self) -> None:
        if self._file is not None and self._out:
            self._file.write("\n".join(self._out) + "\n")
            self._file.flush()
        self._out = []

    def close(self) -> None:
        """Wait for the device, write every line left and close the file."""
        if self._file is None:
            return
        if self._cuda and self._pending:
            torch.cuda.synchronize(self._device)
        self._collect(force=True)
        self._write()
        self._file.close()
        self._file = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._triton_hooked:
            runtime = sys.modules["triton"].knobs.runtime
            runtime.jit_post_compile_hook = None
