"""select_kernels: the reference without a registry, the ranked choice with one; layers take a set."""

from __future__ import annotations

import types

import pytest
import torch

from minisgl.engine.sampling import Sampler
from minisgl.kernel import KernelSet, select_kernels
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.layers import RMSNorm
from minisgl.plugins import KernelSetSpec, PluginSource, UnknownComponentError, Unsupported, hookimpl, load_plugins
from minisgl.testing.kernels import KernelSetConformance


class HalfOnly(KernelSet):
    name = "half"


def _half_only(device: torch.device, dtype: torch.dtype) -> KernelSet:
    if dtype != torch.float16:
        raise Unsupported("float16 only")
    return HalfOnly()


def _registry():  # type: ignore[no-untyped-def]
    module = types.ModuleType("half_kernels")

    @hookimpl
    def minisgl_kernel_sets() -> list[KernelSetSpec]:
        return [KernelSetSpec(name="half", factory=_half_only, auto=True)]

    module.minisgl_kernel_sets = minisgl_kernel_sets  # type: ignore[attr-defined]
    return load_plugins(only=["builtin", "half"], extra=[PluginSource("half", module)], environ={})


def test_without_a_registry_the_reference() -> None:
    for device, dtype in (("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.bfloat16)):
        for choice in ("auto", "torch"):
            kernels = select_kernels(device, dtype, choice)
            assert type(kernels) is KernelSet and kernels.gumbel_sample is None
    with pytest.raises(ValueError, match="kernel set 'native' comes from a plugin"):
        select_kernels("cpu", torch.float32, "native")


def test_auto_takes_the_best_ranked_set_that_serves_the_dtype() -> None:
    registry = _registry()
    assert [s.name for s in registry.ranked("kernels", "cpu")] == ["half", "torch"]
    assert type(select_kernels("cpu", torch.float16, "auto", registry)) is HalfOnly
    assert type(select_kernels("cpu", torch.float32, "auto", registry)) is KernelSet  # half raised Unsupported
    assert type(select_kernels("cpu", torch.float16, "torch", registry)) is KernelSet
    with pytest.raises(UnknownComponentError, match="kernel set 'half' cannot run torch.float32 on cpu: float16 only"):
        select_kernels("cpu", torch.float32, "half", registry)
    with pytest.raises(
        UnknownComponentError, match=r"unknown kernel set 'hlf'; installed: half \(half\), torch \(minisgl\)"
    ):
        select_kernels("cpu", torch.float32, "hlf", registry)


def test_layers_default_to_the_reference_and_take_a_set() -> None:
    plain = KernelSet()
    assert RMSNorm(8, kernels=plain).kernels is plain
    assert type(RMSNorm(8).kernels) is KernelSet
    assert MHAKVPool(KVLayout(1, 2, 4, 1, 8, torch.float32, torch.device("cpu"), plain)).kernels is plain
    assert Sampler(torch.device("cpu"), 0, plain).kernels is plain


class WrongNorm(KernelSet):
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return super().rmsnorm(x, weight, eps * 1e4)


class TestKitOnTheReference(KernelSetConformance):
    kernel_set = "torch"


def test_the_kit_catches_a_wrong_op() -> None:
    kit = KernelSetConformance()
    with pytest.raises(AssertionError):
        kit.test_rmsnorm(WrongNorm(), rows=5, column_major=False)
