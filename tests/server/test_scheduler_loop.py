"""The scheduler process's loop on its own (no engine): what the heartbeat reports while the loop is busy, inside
a step or taking requests, and that a grammar request is accepted only once its grammar compiled."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from minisgl.core import ReqStatus, SamplingParams, ValidationError
from minisgl.message import StepOutput, TokenizedReq, decode, encode
from minisgl.server.workers import _Progress, _serve


class FakeKV:
    cache_pages = used_pages = usable_pages = free_pages = reserved_pages = 0


class FakeReq:
    def __init__(self, rid: int, params: SamplingParams, status: ReqStatus):
        self.rid, self.params, self.status, self.prompt_len = rid, params, status, 3


class FakeScheduler:
    """Takes requests (``add_gate`` holds add_request), compiles nothing, runs empty steps; a request with a
    grammar is COMPILING until ``ready`` is called."""

    def __init__(self) -> None:
        self.kv = FakeKV()
        self.stats = {"preemptions": 0}
        self.add_gate = threading.Event()
        self.add_gate.set()
        self.compiling: list[FakeReq] = []
        self.outcomes: list[tuple[Any, ValidationError | None]] = []
        self.num_running = self.num_waiting = self.num_compiling = 0

    @property
    def has_work(self) -> bool:
        # An outcome not yet taken is work, as in the real scheduler, where a finished compile stays in its
        # compiles until the step collects it (else the loop could go idle between ready() and its next check).
        return bool(self.compiling or self.outcomes)

    def add_request(self, input_ids: list[int], params: SamplingParams, rid: int) -> FakeReq:
        self.add_gate.wait(10)
        status = ReqStatus.COMPILING if params.grammar is not None else ReqStatus.WAITING
        req = FakeReq(rid, params, status)
        if status is ReqStatus.COMPILING:
            self.compiling.append(req)
        return req

    def ready(self, error: ValidationError | None = None) -> None:
        req = self.compiling.pop(0)
        self.outcomes.append((req, error))

    def step(self) -> list[Any]:
        time.sleep(0.001)
        return []

    def take_grammar_outcomes(self) -> list[tuple[Any, ValidationError | None]]:
        out, self.outcomes = self.outcomes, []
        return out

    def abort(self, rid: int, reason: str = "abort") -> None:
        return None


def _loop(sched: FakeScheduler) -> tuple[Any, Any, Any, _Progress, list[int], threading.Thread]:
    ctx = zmq.Context.instance()
    inbox, feed = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://sched-in")
    feed.connect("inproc://sched-in")
    outbox, out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out.bind("inproc://sched-out")
    outbox.connect("inproc://sched-out")
    progress = _Progress(sched, lambda: None)
    stopping: list[int] = []
    thread = threading.Thread(target=_serve, args=(sched, None, inbox, outbox, stopping, progress), daemon=True)
    thread.start()
    return feed, out, (inbox, outbox), progress, stopping, thread


def _next_output(out: Any, timeout_ms: int = 5000) -> StepOutput:
    assert out.poll(timeout_ms), "the loop sent nothing"
    msg = decode(out.recv())
    assert isinstance(msg, StepOutput)
    return msg


def test_the_heartbeat_sees_the_loop_busy_taking_requests_and_a_grammar_accepted_once_compiled() -> None:
    sched = FakeScheduler()
    feed, out, sockets, progress, stopping, thread = _loop(sched)
    try:
        # Taking a request that holds the loop: the heartbeat's probe says busy (outside any step).
        sched.add_gate.clear()
        feed.send(encode(TokenizedReq(1, [1, 2, 3], SamplingParams(max_tokens=4).to_dict())))
        deadline = time.monotonic() + 5
        while progress.probe()[0] < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert progress.probe()[0] >= 0.2
        sched.add_gate.set()
        assert [a[0] for a in _next_output(out).accepted] == [1]
        assert progress.probe()[0] < 0.2
        # A grammar request: accepted only when its grammar compiled; a refused one is a failure on its field.
        grammar = SamplingParams(max_tokens=4, grammar=("regex", "a+")).to_dict()
        feed.send(encode(TokenizedReq(2, [1, 2], grammar)))
        feed.send(encode(TokenizedReq(3, [1, 2], grammar)))
        deadline = time.monotonic() + 5
        while len(sched.compiling) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not out.poll(200)  # nothing accepted while they compile
        sched.ready()
        assert [a[0] for a in _next_output(out).accepted] == [2]
        sched.ready(ValidationError("grammar", "too slow"))
        assert _next_output(out).failed == [[3, "grammar", "too slow"]]
    finally:
        stopping.append(1)
        thread.join(5)
        for sock in (feed, out, *sockets):
            sock.close(0)
