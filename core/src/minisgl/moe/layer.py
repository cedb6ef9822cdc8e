"""The sparse mixture-of-experts block: a router and expert weights stacked and split like a dense gated MLP
(``w13`` ``[experts, 2 * inter / tp, hidden]``: this rank's gate rows, then its up rows; ``w2`` ``[experts, hidden,
inter / tp]``). Checkpoints load per expert (``experts.<e>.<gate|up|down>_proj.weight``, as transformers writes
them) or fused (``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``, ``experts.down_proj``). The layer's
quantization method creates the weights (and any scales: ``experts.<e>.<part>_proj.weight_scale_inv`` loads into
``w13_weight_scale_inv`` or ``w2_weight_scale_inv``, sliced as the weight's rows and columns are)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet
from ..layers import UNQUANTIZED, QuantMethod, ReplicatedLinear
from .base import BaseMoEBackend, ExpertScales, route
from .torch_backend import TorchMoEBackend

# experts.<e>.<gate|up|down>_proj.<weight|weight_scale_inv|weight_scale> (one expert's tensor) or
# experts.<gate_up|down>_proj[.weight] (fused).
_EXPERT = re.compile(
    r"\.experts\.(?:(\d+)\.(gate|up|down)_proj\.(weight(?:_scale_inv|_scale)?)|(gate_up|down)_proj(?:\.weight)?)$"
)
_PARTS = ("gate", "up", "down")


def expert_weight_target(name: str) -> tuple[str, tuple[str, int | None]] | None:
    """``(parameter name, (part, expert))`` of an expert's checkpoint tensor, or None for other names: ``part``
    is gate, up or down for one expert's matrix (or its scale: ``...weight_scale_inv`` targets
    ``w13_weight_scale_inv``), gate_up or down with expert None for the fused layout. Model files call this from
    :meth:`~minisgl.models.CausalLM.map_weight_name` first."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    expert, part, suffix = (int(m[1]), m[2], m[3]) if m[1] is not None else (None, m[4], "weight")
    param = f"w2_{suffix}" if part == "down" else f"w13_{suffix}"
    return f"{name[: m.start()]}.experts.{param}", (part, expert)


class MoEExperts(nn.Module):
    """The routed experts of one layer: stacked weights (created by ``quant``, the engine's quantization method),
    their loaders, the backend call and the all-reduce. ``scales`` is set by a method that keeps quantized
    weights (:class:`~minisgl.moe.ExpertScales`), None otherwise."""

    w13_weight: nn.Parameter  # created by the quantization method, with any scales it needs
    w2_weight: nn.Parameter

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
        quant: QuantMethod = UNQUANTIZED,
    ):
        super().__init__()
        self.backend = backend if backend is not None else TorchMoEBackend()
        self.tp = tp
        self.comm = comm or SingleCommunicator()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_inter = tp.shard(intermediate_size, "MoE expert intermediate size")
        self.dtype = dtype
        self.scales: ExpertScales | None = None
        # Which (part, expert) slices a checkpoint has filled, so a partial checkpoint is an error, not garbage.
        self._loaded: set[tuple[str, int]] = set()
        self._build(quant, device)

    def _build(self, quant: QuantMethod, device: torch.device | None) -> None:
        self.quant = quant
        quant.create_expert_weights(self, self.dtype, device)

    def use_quant(self, quant: QuantMethod) -> None:
        """Re-create the expert weights with ``quant`` (at build time, before loading)."""
        device = self.w13_weight.device
        for name in list(self._parameters):  # every name: a scale may be registered under two
            delattr(self, name)  # the previous method's weights and scales
        self.scales = None
        self._build(quant, device)

    def checkpoint_modules(self, name: str) -> list[str]:
        """The checkpoint modules these experts (module ``name``, e.g. ``model.layers.0.mlp.experts``) hold."""
        return [f"{name}.{e}.{p}_proj" for e in range(self.num_experts) for p in _PARTS]

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's slice of a checkpoint tensor; ``shard_id`` comes from :func:`expert_weight_target`.
        Gate and up rows are split over ranks; down columns too where the checkpoint tensor has one column per
        input column or block (the weight, block scales), and are copied whole where it has the parameter's
        columns (a per-row scale). The weights' shapes are checked exactly; a scale's loader passes it expanded
        to one row per weight row."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"an expert weight needs a (part, expert) shard id, got {shard_id!r}")
        part, expert = shard_id
        experts = range(self.num_experts) if expert is None else [expert]
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, but the model has {self.num_experts} experts")
        n, inter, hidden = self.local_inter, self.intermediate_size, self.hidden_size
        weight = param is self.w13_weight or param is self.w2_weight
        cols = param.shape[2]
        lo = self.tp.rank * n
        if part in ("gate", "up") and expert is not None:
            self._check(loaded, (inter, hidden if weight else cols), f"expert {expert} {part}_proj")
            offset = 0 if part == "gate" else n
            param.data[expert, offset : offset + n].copy_(loaded[lo : lo + n])
            self._mark(weight, part, experts)
        elif part == "down" and expert is not None:
            self._check(loaded, (hidden, inter if weight else loaded.shape[1]), f"expert {expert} down_proj")
            param.data[expert].copy_(self._down_columns(loaded, cols, f"expert {expert} down_proj"))
            self._mark(weight, "down", experts)
        elif part == "gate_up":
            self._check(loaded, (self.num_experts, 2 * inter, hidden if weight else cols), "experts.gate_up_proj")
            param.data[:, :n].copy_(loaded[:, lo : lo + n])
            param.data[:, n:].copy_(loaded[:, inter + lo : inter + lo + n])
            self._mark(weight, "gate", experts)
            self._mark(weight, "up", experts)
        elif part == "down":
            full = inter if weight else loaded.shape[2]
            self._check(loaded, (self.num_experts, hidden, full), "experts.down_proj")
            param.data.copy_(self._down_columns(loaded, cols, "experts.down_proj"))
            self._mark(weight, "down", experts)
        else:
            raise ValueError(
                f"unsupported expert weight shard {shard_id!r}; expected (gate|up|down, expert) or (gate_up|down, None)"
            )

    def _down_columns(self, loaded: torch.Tensor, cols: int, what: str) -> torch.Tensor:
        """This rank's columns of a down tensor: all of them when it has the parameter's ``cols``."""
        if loaded.shape[-1] == cols:
            return loaded
        if loaded.shape[-1] != cols * self.tp.size:
            raise ValueError(
                f"checkpoint tensor {what} has {loaded.shape[-1]} columns, expected {cols * self.tp.size} "
                f"({cols} per tensor-parallel rank) or {cols}"
            )
        return loaded[..., self.tp.rank * cols : (self.tp.rank + 1) * cols]

    def _mark(self, weight: bool, part: str, experts: Any) -> None:
        if weight:
            self._loaded.update((part, e) for e in experts)

    @staticmethod
    def _check(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor {what} has shape {tuple(loaded.shape)}, expected {expected}")

    def missing_weights(self) -> list[str]:
        """Expert matrices no checkpoint tensor has filled, e.g. ``['expert 3 up_proj']``."""
        return [f"expert {e} {p}_proj" for e in range(self.num_experts) for p in _PARTS if (p, e) not in self._loaded]

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            out = self.backend.forward(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            out = self.backend.forward(  # type: ignore[call-arg]  # a backend listing expert_dtypes takes scales
                hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, scales=self.scales
            )
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
        quant: QuantMethod = UNQUANTIZED,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top-k ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.top_k = top_k
        self.renormalize = renormalize
        # The router stays in the model's dtype: quantized checkpoints store it so, and MoE runtimes keep it so.
        self.gate = ReplicatedLinear(
            hidden_size, num_experts, dtype=dtype, device=device, kernels=kernels, quantize=False
        )
        self.experts = MoEExperts(
            num_experts,
            hidden_size,
            intermediate_size,
            backend=backend,
            tp=tp,
            comm=comm,
            dtype=dtype,
            device=device,
            quant=quant,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(hidden), self.top_k, self.renormalize)
        return self.experts(hidden, weights, ids)
