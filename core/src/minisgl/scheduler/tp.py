"""Starting a scheduler (:func:`start_scheduler`) and, with tensor parallelism, the other ranks' processes.

Every rank runs the same batches in the same order: before each step rank 0's :class:`ReplicatedScheduler`
broadcasts the requests added and aborted since the last one, and the other ranks replay them (:func:`follow`),
so batches, pages and sampling are identical and the collectives line up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from ..config import EngineConfig
from ..core import Req, ReqStatus, SamplingParams
from ..distributed.group import ControlChannel, TPGroup, free_port, join_group
from ..engine import Engine
from ..models import eos_token_ids, load_tokenizer
from ..plugins import PluginRegistry, load_plugins
from .scheduler import Scheduler, TokenEvent

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed to start or died."""


class ReplicatedScheduler(Scheduler):
    """Rank 0's scheduler: a :class:`Scheduler` whose calls are mirrored to the other ranks."""

    def __init__(self, engine: Engine, *, control: ControlChannel, **kwargs: Any):
        super().__init__(engine, **kwargs)
        self.control = control
        self._pending: list[list[Any]] = []
        self._late_ends: list[Req] = []

    def add_request(self, input_ids: Sequence[int], params: SamplingParams, rid: int | None = None) -> Req:
        req = super().add_request(input_ids, params, rid)  # validation errors stop here, unmirrored
        # Whether it was queued at once (its grammar cached here): then the others queue it at once too.
        queued = req.status is not ReqStatus.COMPILING
        self._pending.append(["add", req.rid, req.input_ids, params.to_dict(), queued])
        return req

    def abort(self, rid: int, reason: str = "abort") -> Req | None:
        req = super().abort(rid, reason)
        if req is not None:
            self._pending.append(["abort", rid])
        return req

    def _grammar_queued(self, req: Req) -> None:
        self._pending.append(["ready", req.rid])

    def _grammar_refused(self, req: Req) -> None:
        self._pending.append(["abort", req.rid])

    def _end_late(self, req: Req) -> bool:
        # Ended before the next step, on every rank at once (the others' masks were not late).
        self._late_ends.append(req)
        return False

    def step(self) -> list[TokenEvent]:
        events = []
        for req in self._late_ends:
            if self.abort(req.rid, "grammar_error") is not None:
                events.append(TokenEvent(req, None, None, True))
        self._late_ends = []
        self._collect_compiles_before_step()  # its outcomes are mirrored with this step
        self._pending.append(["step"])
        self.control.broadcast(msgpack.packb(self._pending))
        self._pending = []
        return events + self._step()

    def stop(self) -> None:
        """Tell the other ranks to leave their loops (pending adds/aborts go first); call it once."""
        self.control.broadcast(msgpack.packb([*self._pending, ["stop"]]))
        self._pending = []


def follow(scheduler: Scheduler, control: ControlChannel) -> None:
    """A non-zero rank's loop: replay rank 0's calls until it says stop. Rank 0 decides when a compiled request
    is queued and which masks were late; this rank's own grammar timings play no part."""
    scheduler.replays = True
    if scheduler.grammar is not None:
        # Rank 0 refuses what is over its limits; here the same compile, run alongside the other ranks' on shared
        # cores, gets a wide margin, since failing what rank 0 compiled would end the whole group.
        limits = scheduler.grammar.limits
        scheduler.grammar.limits = dataclasses.replace(
            limits,
            compile_seconds=None if limits.compile_seconds is None else 4 * limits.compile_seconds + 10,
            compile_memory_bytes=None if limits.compile_memory_bytes is None else 2 * limits.compile_memory_bytes,
            mask_seconds=None,
        )
    while True:
        for msg in msgpack.unpackb(control.broadcast(), strict_map_key=False):
            kind = msg[0]
            if kind == "add":
                scheduler.add_request(msg[2], SamplingParams.from_dict(msg[3]), rid=msg[1])
                if msg[4]:
                    scheduler.queue_compiled(msg[1])
            elif kind == "ready":
                scheduler.queue_compiled(msg[1])
            elif kind == "abort":
                scheduler.abort(msg[1])
            elif kind == "step":
                scheduler.step()
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown control message {kind!r} from rank 0")


def _scheduler_for(engine: Engine, tokenizer: Any, control: ControlChannel | None = None) -> Scheduler:
    """``engine``'s scheduler: it stops at the model's EOS tokens and, given ``tokenizer``, at stop strings, and
    compiles grammars; with ``control``, rank 0's :class:`ReplicatedScheduler`."""
    eos = eos_token_ids(engine.hf_config, tokenizer, engine.source)
    detok = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None
    kwargs: dict[str, Any] = {"eos_token_ids": eos, "detokenize": detok, "tokenizer": tokenizer}
    return Scheduler(engine, **kwargs) if control is None else ReplicatedScheduler(engine, control=control, **kwargs)


def start_scheduler(
    config: EngineConfig, registry: PluginRegistry | None = None, tokenizer: Any = None
) -> tuple[Scheduler, RankProcesses | None, Any]:
    """This process's scheduler (with ``tp > 1`` rank 0's, the other ranks started), those ranks (else None), and
    the tokenizer: ``tokenizer``, else the model's (with ``tp > 1`` the scheduler always uses the model's)."""
    if config.tp > 1:
        reg = registry if registry is not None else load_plugins(config.plugins, paths=config.plugin_paths)
        config = _with_store_address(config)
        if config.node_rank != 0:
            raise TensorParallelError("rank 0 runs on node 0; other nodes run followers only")
        config = config.with_changes(plugins=tuple(reg.active_plugin_names()))
        ranks = RankProcesses(config)
        try:
            scheduler, _, own_tokenizer = build_rank(config, 0, 0, reg, ranks)
        except BaseException:
            ranks.kill()
            raise
        return scheduler, ranks, tokenizer if tokenizer is not None else own_tokenizer
    engine = Engine(config, registry)
    if tokenizer is None and engine.source is not None:
        tokenizer = load_tokenizer(engine.source)
    return _scheduler_for(engine, tokenizer), None, tokenizer


def step_naming_dead_rank(scheduler: Scheduler, ranks: RankProcesses | None) -> list[TokenEvent]:
    """``scheduler.step()``; when it fails and one of ``ranks`` has exited (within 5 s), the error is a
    :class:`TensorParallelError` naming that rank, not the closed connection. A dead rank would hang the next
    collective, so callers also run ``ranks.check_alive()`` between steps."""
    try:
        return scheduler.step()
    except RuntimeError:
        if ranks is not None:
            ranks.check_alive(grace=5.0)
        raise


def _with_store_address(config: EngineConfig) -> EngineConfig:
    """``config`` with rank 0's store address (on one node a free local port), after checking this node's GPUs."""
    if config.nnodes > 1 and not config.dist_init_addr:
        raise ValueError("several nodes need --dist-init-addr HOST:PORT (reachable from every node)")
    per_node = config.tp // config.nnodes
    if config.device.startswith("cuda"):
        import torch

        if per_node > (have := torch.cuda.device_count()):
            raise TensorParallelError(
                f"--tp {config.tp} over {config.nnodes} node(s) needs {per_node} GPUs on this node, found {have}"
            )
    return config.with_changes(dist_init_addr=config.dist_init_addr or f"127.0.0.1:{free_port()}")


def build_rank(
    config: EngineConfig, rank: int, local_rank: int, registry: PluginRegistry | None, ranks: RankProcesses | None
) -> tuple[Scheduler, TPGroup, Any]:
    """Join the group (watching the started ``ranks`` meanwhile) and build this rank's engine, (local)
    scheduler and tokenizer; on CUDA each rank uses GPU ``local_rank``."""
    import torch

    cfg = config.with_changes(device=f"cuda:{local_rank}") if config.device.startswith("cuda") else config
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    addr = cfg.dist_init_addr
    assert addr is not None  # set by _with_store_address before any rank starts
    join = lambda: join_group(rank, cfg.tp, addr, device)  # noqa: E731
    group = join() if ranks is None else ranks.while_alive(join, "joining the group")
    engine = Engine(cfg, registry, tp=group.tp, comm=group.comm)
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    logger.info("tensor-parallel rank %d/%d: %.1f MiB of weights on %s", rank, cfg.tp, params / 2**20, cfg.device)
    # Every rank masks its own (identical) logits, so every rank compiles the grammars too.
    tokenizer = load_tokenizer(engine.source) if engine.source is not None else None
    return _scheduler_for(engine, tokenizer, group.control if rank == 0 else None), group, tokenizer


def follower_main() -> None:
    """Body of a non-zero rank's process (``python -m minisgl.scheduler.tp_rank``): its launch on stdin."""
    launch = json.loads(sys.stdin.buffer.read())
    rank = launch["rank"]
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    parent = os.getppid()

    def watch_parent() -> None:  # no orphaned ranks
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                logger.error("parent process %d is gone; tensor-parallel rank exiting", parent)
                os._exit(1)

    threading.Thread(target=watch_parent, name="parent-watchdog", daemon=True).start()
    scheduler, group, _ = build_rank(EngineConfig(**launch["config"]), rank, launch["local_rank"], None, None)
    follow(scheduler, group.control)


class RankProcess(subprocess.Popen[bytes]):
    """One rank's process: a fresh interpreter (``python -m minisgl.scheduler.tp_rank``), arguments on stdin.

    Not a fork (CUDA and threads do not survive one), nor a multiprocessing spawn (it re-runs a caller's script
    that lacks a ``__main__`` guard)."""

    def __init__(self, name: str, launch: dict[str, Any]):
        self.name = name
        env = dict(os.environ)
        # The rank must import this same minisgl, also when the caller put it on sys.path by hand.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        super().__init__([sys.executable, "-m", "minisgl.scheduler.tp_rank"], stdin=subprocess.PIPE, env=env)
        assert self.stdin is not None
        # A rank that died at once closed its end; the watch on its exit reports it.
        with contextlib.suppress(BrokenPipeError), self.stdin:
            self.stdin.write(json.dumps(launch).encode())

    def is_alive(self) -> bool:
        return self.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout)


class RankProcesses:
    """The started ranks of this node: node ``k`` runs ranks ``k * tp / nnodes ..``, all but rank 0 on node 0."""

    def __init__(self, config: EngineConfig):
        launch = {"config": config.model_dump(mode="json")}
        per_node = config.tp // config.nnodes
        first = config.node_rank * per_node
        self.procs = [
            RankProcess(f"minisgl-tp-rank{rank}", {**launch, "rank": rank, "local_rank": local})
            for local, rank in enumerate(range(first, first + per_node))
            if rank != 0
        ]

    def while_alive(self, wait: Callable[[], T], what: str) -> T:
        """``wait()`` (in a helper thread), failing at once when a rank exits meanwhile: joining the group
        would otherwise surface a rank that died first only at the store's timeout, minutes later."""
        outcome: Future[T] = Future()

        def run() -> None:
            try:
                outcome.set_result(wait())
            except BaseException as exc:  # handed to the caller's thread
                outcome.set_exception(exc)

        thread = threading.Thread(target=run, name="tp-wait", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            for p in self.procs:
                if not p.is_alive():
                    raise TensorParallelError(
                        f"tensor-parallel {p.name} (pid {p.pid}) exited with code {p.returncode} before "
                        f"{what}; its own error is in the output above"
                    )
        return outcome.result()

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise naming the first rank that has exited; wait up to ``grace`` seconds for one to (after a
        collective failed on a closed connection, so the error names the rank instead of the transport)."""
        deadline = time.monotonic() + grace
        while True:
            for p in self.procs:
                if not p.is_alive():
                    raise TensorParallelError(f"tensor-parallel {p.name} exited with code {p.returncode}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def shutdown(self, scheduler: ReplicatedScheduler, timeout: float = 30.0) -> None:
        """Stop the ranks: through rank 0 if all are alive (else the collective would fail on a closed
        connection, masking the original error), then make sure they are gone."""
        try:
            if all(p.is_alive() for p in self.procs):
                try:
                    scheduler.stop()
                except RuntimeError as exc:
                    logger.warning("could not tell the other ranks to stop (%s); killing them", exc)
                else:
                    for p in self.procs:
                        p.join(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            p.kill()  # a no-op once it has exited
        for p in self.procs:
            p.join(5)


def run_follower_node(config: EngineConfig) -> int:
    """A node other than node 0: start its ranks and wait for them."""
    config = _with_store_address(config)
    registry = load_plugins(config.plugins, paths=config.plugin_paths)
    procs = RankProcesses(config.with_changes(plugins=tuple(registry.active_plugin_names())))
    for p in procs.procs:
        p.join()
    return max((p.returncode or 0 for p in procs.procs), default=0)
