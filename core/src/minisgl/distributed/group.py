"""Joining a tensor-parallel group without touching torch.distributed's global state: each rank builds its own
process groups from a TCP store (no ``init_process_group``), so a group belongs to the engine that made it and
several groups in one process do not interfere: one for tensors (NCCL on CUDA, gloo on CPU) and a gloo one for
rank 0's control messages (:class:`ControlChannel`)."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch

from . import Communicator, TorchDistCommunicator, TPInfo

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


class ControlChannel:
    """Rank 0 broadcasts byte messages (msgpack) to every other rank, in order."""

    def __init__(self, pg: Any):
        self.pg = pg

    def broadcast(self, payload: bytes | None = None) -> bytes:
        """Rank 0 passes ``payload``; every rank returns it."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        if payload:  # rank 0
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            self.pg.broadcast(data, 0).wait()
        return bytes(data.numpy().tobytes())


@dataclass
class TPGroup:
    """This rank's place in the group and its communication objects (``store`` kept alive with them)."""

    tp: TPInfo
    comm: Communicator
    control: ControlChannel
    store: Any


def join_group(
    rank: int, world_size: int, addr: str, device: torch.device, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> TPGroup:
    """Join the group whose store rank 0 hosts at ``addr`` (HOST:PORT)."""
    import torch.distributed as dist

    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"distributed init address must look like HOST:PORT, got '{addr}'")
    try:
        store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise DistributedError(
            f"rank {rank} could not reach the tensor-parallel group at {addr}: {exc}; "
            "check --dist-init-addr and that rank 0 is running"
        ) from exc
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, CONTROL_TIMEOUT)
    tensors = dist.PrefixStore("tensors", store)
    if device.type == "cuda":
        pg: Any = dist.ProcessGroupNCCL(tensors, rank, world_size, dist.ProcessGroupNCCL.Options())
    else:
        pg = dist.ProcessGroupGloo(tensors, rank, world_size, timeout)
    comm = TorchDistCommunicator(pg, world_size)
    return TPGroup(TPInfo(rank, world_size), comm, ControlChannel(ctrl), store)
