"""The sparse mixture-of-experts block: a router and expert weights stacked and split like a dense gated MLP
(``w13`` ``[experts, 2 * inter / tp, hidden]``: this rank's gate rows, then its up rows; ``w2`` ``[experts, hidden,
inter / tp]``). Checkpoints load per expert (``experts.<e>.<gate|up|down>_proj.weight``, as transformers writes
them) or fused (``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``, ``experts.down_proj``)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet
from ..layers import ReplicatedLinear, set_loader
from .base import BaseMoEBackend, route
from .torch_backend import TorchMoEBackend

# experts.<e>.<gate|up|down>_proj.weight (one expert's matrix) or experts.<gate_up|down>_proj[.weight] (fused).
_EXPERT = re.compile(r"\.experts\.(?:(\d+)\.(gate|up|down)_proj\.weight|(gate_up|down)_proj(?:\.weight)?)$")


def expert_weight_target(name: str) -> tuple[str, tuple[str, int | None]] | None:
    """``(parameter name, (part, expert))`` of an expert's checkpoint tensor, or None for other names: ``part``
    is gate, up or down for one expert's matrix, gate_up or down with expert None for the fused layout. Model
    files call this from :meth:`~minisgl.models.CausalLM.map_weight_name` first."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    expert, part = (int(m[1]), m[2]) if m[1] is not None else (None, m[3])
    param = "w2_weight" if part == "down" else "w13_weight"
    return f"{name[: m.start()]}.experts.{param}", (part, expert)


class MoEExperts(nn.Module):
    """The routed experts of one layer: stacked weights, their loaders, the backend call and the all-reduce."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        backend: BaseMoEBackend | None = None,
        tp: TPInfo = TPInfo(),
        comm: Communicator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.backend = backend if backend is not None else TorchMoEBackend()
        self.tp = tp
        self.comm = comm or SingleCommunicator()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_inter = tp.shard(intermediate_size, "MoE expert intermediate size")
        shape = (num_experts, 2 * self.local_inter, hidden_size)
        self.w13_weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        shape = (num_experts, hidden_size, self.local_inter)
        self.w2_weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        set_loader(self.w13_weight, self.load_weight)
        set_loader(self.w2_weight, self.load_weight)
        # Which (part, expert) slices a checkpoint has filled, so a partial checkpoint is an error, not garbage.
        self._loaded: set[tuple[str, int]] = set()

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's slice of a checkpoint tensor; ``shard_id`` comes from :func:`expert_weight_target`."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"an expert weight needs a (part, expert) shard id, got {shard_id!r}")
        part, expert = shard_id
        experts = range(self.num_experts) if expert is None else [expert]
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, but the model has {self.num_experts} experts")
        n, inter, hidden = self.local_inter, self.intermediate_size, self.hidden_size
        lo = self.tp.rank * n
        if part in ("gate", "up") and expert is not None:
            self._check(loaded, (inter, hidden), f"expert {expert} {part}_proj")
            offset = 0 if part == "gate" else n
            param.data[expert, offset : offset + n].copy_(loaded[lo : lo + n])
            self._loaded.add((part, expert))
        elif part == "down" and expert is not None:
            self._check(loaded, (hidden, inter), f"expert {expert} down_proj")
            param.data[expert].copy_(loaded[:, lo : lo + n])
            self._loaded.add(("down", expert))
        elif part == "gate_up":
            self._check(loaded, (self.num_experts, 2 * inter, hidden), "experts.gate_up_proj")
            param.data[:, :n].copy_(loaded[:, lo : lo + n])
            param.data[:, n:].copy_(loaded[:, inter + lo : inter + lo + n])
            self._loaded.update((p, e) for p in ("gate", "up") for e in experts)
        elif part == "down":
            self._check(loaded, (self.num_experts, hidden, inter), "experts.down_proj")
            param.data.copy_(loaded[:, :, lo : lo + n])
            self._loaded.update(("down", e) for e in experts)
        else:
            raise ValueError(
                f"unsupported expert weight shard {shard_id!r}; expected (gate|up|down, expert) or (gate_up|down, None)"
            )

    @staticmethod
    def _check(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor {what} has shape {tuple(loaded.shape)}, expected {expected}")

    def missing_weights(self) -> list[str]:
        """Expert matrices no checkpoint tensor has filled, e.g. ``['expert 3 up_proj']``."""
        return [
            f"expert {e} {p}_proj"
            for e in range(self.num_experts)
            for p in ("gate", "up", "down")
            if (p, e) not in self._loaded
        ]

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.backend.forward(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.tp.size > 1:
            out = self.comm.all_reduce(out)
        return out


class SparseMoEBlock(nn.Module):
    """Top-k softmax router (``gate``, replicated), then the routed ``experts``; ``renormalize`` rescales
    each token's top-k weights to sum to one (Qwen3-MoE's ``norm_topk_prob``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool,
        backend: BaseMoEBackend | None = None,
        tp: TPInfo = TPInfo(),
        comm: Communicator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        kernels: KernelSet | None = None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top-k ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype=dtype, device=device, kernels=kernels)
        self.experts = MoEExperts(
            num_experts, hidden_size, intermediate_size, backend=backend, tp=tp, comm=comm, dtype=dtype, device=device
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(hidden), self.top_k, self.renormalize)
        return self.experts(hidden, weights, ids)
