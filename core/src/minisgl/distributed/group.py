"""Joining a tensor-parallel group without touching torch.distributed's global state.

Each rank builds its own process-group objects from a TCP store, so the group
belongs to the engine that made it (no ``init_process_group``): two engines in
one process, or a test that makes several groups, do not interfere. Two groups
are made: one for tensors (NCCL on CUDA, gloo on CPU) and a gloo one for
control messages from rank 0 (:class:`ControlChannel`).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch

from .comm import Communicator
from .info import TPInfo

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)
# Followers wait on the control channel for as long as rank 0 is idle (a server with no
# requests), so it never times out; a dead peer is noticed through its closed connection.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class DistributedError(RuntimeError):
    """A rank could not join the group, or a peer is gone."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"distributed init address must look like HOST:PORT, got '{addr}'")
    return host, int(port)


class ProcessGroupCommunicator(Communicator):
    """All-reduce and all-gather on a process-group object owned by this communicator."""

    def __init__(self, pg: Any, world_size: int):
        self.pg = pg
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)


class ControlChannel:
    """Rank 0 broadcasts byte messages (msgpack) to every other rank, in order."""

    def __init__(self, pg: Any, rank: int):
        self.pg = pg
        self.rank = rank

    def broadcast(self, payload: bytes | None = None) -> bytes:
        """Rank 0 passes ``payload``; every rank returns it."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        if self.rank == 0:
            assert payload is not None
            data = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if payload
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            self.pg.broadcast(data, 0).wait()
        return bytes(data.numpy().tobytes())


@dataclass
class TPGroup:
    """This rank's place in the group and its communication objects."""

    tp: TPInfo
    comm: Communicator
    control: ControlChannel
    store: Any


def join_group(
    rank: int,
    world_size: int,
    addr: str,
    device: torch.device,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> TPGroup:
    """Join the group whose store rank 0 hosts at ``addr`` (HOST:PORT)."""
    import torch.distributed as dist

    host, port = parse_addr(addr)
    try:
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise DistributedError(
            f"rank {rank} could not reach the tensor-parallel group at {addr}: {exc}; "
            "check --dist-init-addr and that rank 0 is running"
        ) from exc
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, CONTROL_TIMEOUT)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        pg: Any = dist.ProcessGroupNCCL(dist.PrefixStore("tensors", store), rank, world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("tensors", store), rank, world_size, timeout)
    return TPGroup(
        TPInfo(rank, world_size), ProcessGroupCommunicator(pg, world_size), ControlChannel(ctrl, rank), store
    )
