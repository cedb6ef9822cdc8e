"""Starting and stopping the ranks of a tensor-parallel engine.

Rank 0 runs where the caller is (the offline ``LLM`` or a server's scheduler
process); the other ranks of this node are processes that build the same
engine on their shard and follow rank 0 (:func:`~.replicated.follow`).
With several nodes (``nnodes``), node ``k`` starts ranks
``k * per_node .. (k + 1) * per_node - 1`` and rank 0's node hosts the store at
``dist_init_addr``.

Each rank is a fresh interpreter running ``python -m minisgl.scheduler.tp_rank``
(never a fork: CUDA and threads do not survive one; nor a multiprocessing
spawn, which re-imports the caller's main module and so runs a plain script
without an ``if __name__ == "__main__":`` guard a second time in every rank).
While rank 0 waits for the group to form it watches those processes, so a rank
that dies first is an error at once, naming the rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..config import EngineConfig
from ..distributed.group import TPGroup, free_port, join_group
from ..engine import Engine
from ..models import eos_token_ids, load_tokenizer
from ..plugins import PluginRegistry
from .replicated import ReplicatedScheduler, exit_with_parent, follow
from .scheduler import Scheduler

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed to start or died."""


@dataclass(frozen=True)
class Topology:
    """Where the ranks are: ``tp`` ranks over ``nnodes`` nodes, this node being ``node_rank``."""

    tp: int
    nnodes: int = 1
    node_rank: int = 0
    addr: str = ""

    def __post_init__(self) -> None:
        if self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} must be a multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.addr:
            raise ValueError("several nodes need --dist-init-addr HOST:PORT (reachable from every node)")

    @property
    def per_node(self) -> int:
        return self.tp // self.nnodes

    def local_ranks(self) -> list[int]:
        first = self.node_rank * self.per_node
        return list(range(first, first + self.per_node))

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        addr = config.dist_init_addr or f"127.0.0.1:{free_port()}"
        return cls(config.tp, config.nnodes, config.node_rank, addr)


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """The config one rank builds its engine from (its own GPU on CUDA)."""
    if config.device.startswith("cuda"):
        return config.with_changes(device=f"cuda:{local_rank}")
    return config


def check_devices(config: EngineConfig, topo: Topology) -> None:
    if config.device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if topo.per_node > have:
            raise TensorParallelError(
                f"--tp {topo.tp} over {topo.nnodes} node(s) needs {topo.per_node} GPUs on this node, found {have}"
            )


def build_rank(
    config: EngineConfig,
    rank: int,
    local_rank: int,
    topo: Topology,
    registry: PluginRegistry | None,
    ranks: RankProcesses | None = None,
) -> tuple[Scheduler, TPGroup, Any]:
    """Join the group and build this rank's engine, (local) scheduler and tokenizer.

    ``ranks``: the processes this one started, watched while the group forms.
    """
    import torch

    cfg = rank_config(config, local_rank)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ranks is None:
        group = join_group(rank, topo.tp, topo.addr, device)
    else:
        group = ranks.while_alive(lambda: join_group(rank, topo.tp, topo.addr, device), "joining the group")
    engine = Engine(cfg, registry, tp=group.tp, comm=group.comm)
    tokenizer = load_tokenizer(engine.source) if engine.source is not None else None
    detok = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    logger.info("tensor-parallel rank %d/%d: %.1f MiB of weights on %s", rank, topo.tp, params / 2**20, cfg.device)
    eos = eos_token_ids(engine.hf_config, tokenizer, engine.source)
    if rank == 0:
        sched = ReplicatedScheduler(
            engine, control=group.control, eos_token_ids=eos, detokenize=detok, tokenizer=tokenizer
        )
        return sched, group, tokenizer
    # Every rank masks its own (identical) logits, so every rank compiles the grammars too.
    return Scheduler(engine, eos_token_ids=eos, detokenize=detok, tokenizer=tokenizer), group, tokenizer


def follower_main(config_fields: dict[str, Any], rank: int, local_rank: int, topo_fields: dict[str, Any]) -> None:
    """Body of a non-zero rank's process (``python -m minisgl.scheduler.tp_rank``)."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    exit_with_parent()
    config = EngineConfig(**config_fields)
    topo = Topology(**topo_fields)
    scheduler, group, _ = build_rank(config, rank, local_rank, topo, None)
    follow(scheduler, group.control)


class RankProcess:
    """One rank's process: a fresh interpreter running :mod:`minisgl.scheduler.tp_rank`, arguments on stdin."""

    def __init__(self, name: str, launch: dict[str, Any]):
        self.name = name
        env = dict(os.environ)
        # The rank must import this same minisgl, also when the caller put it on sys.path by hand.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "minisgl.scheduler.tp_rank"]
        self.popen = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
        assert self.popen.stdin is not None
        # A rank that died at once closed its end; the watch on its exit reports it.
        with contextlib.suppress(BrokenPipeError), self.popen.stdin:
            self.popen.stdin.write(json.dumps(launch).encode())

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; negative for a signal, as for multiprocessing."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()


class RankProcesses:
    """The started ranks of this node (all but rank 0 on node 0)."""

    def __init__(self, config: EngineConfig, topo: Topology):
        fields = config.model_dump(mode="json")
        self.procs: list[RankProcess] = []
        for local, rank in enumerate(topo.local_ranks()):
            if rank == 0:
                continue
            launch = {"config": fields, "rank": rank, "local_rank": local, "topology": asdict(topo)}
            self.procs.append(RankProcess(f"minisgl-tp-rank{rank}", launch))

    def while_alive(self, wait: Callable[[], T], what: str) -> T:
        """``wait()`` (run in a helper thread), failing at once when one of the ranks exits meanwhile.

        Joining the group blocks until every rank has connected; a rank that died first (a bad
        install, an import error) would otherwise surface only at the store's timeout, minutes later.
        """
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append((True, wait()))
            except BaseException as exc:  # handed to the caller's thread
                outcome.append((False, exc))

        thread = threading.Thread(target=run, name="tp-wait", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            for p in self.procs:
                if not p.is_alive():
                    raise TensorParallelError(
                        f"tensor-parallel {p.name} (pid {p.pid}) exited with code {p.exitcode} before "
                        f"{what}; its own error is in the output above"
                    )
        ok, value = outcome[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise naming the first rank that has exited; wait up to ``grace`` seconds for one to.

        After a collective failed on a closed connection, a short grace lets the dead rank's exit be
        seen, so the error names the rank instead of the transport.
        """
        deadline = time.monotonic() + grace
        while True:
            for p in self.procs:
                if not p.is_alive():
                    raise TensorParallelError(f"tensor-parallel {p.name} exited with code {p.exitcode}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def join(self, timeout: float = 30.0) -> None:
        for p in self.procs:
            p.join(timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    def shutdown(self, scheduler: ReplicatedScheduler, timeout: float = 30.0) -> None:
        """Stop the ranks: tell them through rank 0 if they are all alive, then make sure they are gone.

        With a rank already dead the stop message cannot be delivered (the collective would fail on
        the closed connection), so the others are killed instead of masking the original error.
        """
        try:
            if all(p.is_alive() for p in self.procs):
                try:
                    scheduler.stop()
                except RuntimeError as exc:
                    logger.warning("could not tell the other ranks to stop (%s); killing them", exc)
                else:
                    self.join(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)


def start_tensor_parallel(
    config: EngineConfig, registry: PluginRegistry
) -> tuple[ReplicatedScheduler, RankProcesses, Any]:
    """Start every local rank; return rank 0's scheduler, the spawned ranks and the tokenizer (node 0 only)."""
    topo = Topology.of(config)
    if topo.node_rank != 0:
        raise TensorParallelError("rank 0 runs on node 0; other nodes run followers only")
    check_devices(config, topo)
    config = config.with_changes(plugins=tuple(registry.active_plugin_names()), dist_init_addr=topo.addr)
    procs = RankProcesses(config, topo)
    try:
        scheduler, _, tokenizer = build_rank(config, 0, 0, topo, registry, procs)
    except BaseException:
        procs.kill()
        raise
    assert isinstance(scheduler, ReplicatedScheduler)
    return scheduler, procs, tokenizer


def run_follower_node(config: EngineConfig) -> int:
    """A node other than node 0: start its ranks and wait for them."""
    topo = Topology.of(config)
    check_devices(config, topo)
    from ..plugins import load_plugins

    registry = load_plugins(config.plugins, paths=config.plugin_paths)
    config = config.with_changes(plugins=tuple(registry.active_plugin_names()))
    procs = RankProcesses(config, topo)
    for p in procs.procs:
        p.join()
    return max((p.exitcode or 0 for p in procs.procs), default=0)
