"""The ``native`` kernel set: the core's kernel-set kit, how it is chosen, and layers built with it."""

from __future__ import annotations

import pytest
import torch
from minisgl_plugin_cpu.kernels import NativeCPUKernels
from minisgl_plugin_cpu.native import load_cpu_kernels

from minisgl.core import Req, SamplingParams
from minisgl.distributed import SingleCommunicator, TPInfo
from minisgl.engine.sampling import Sampler
from minisgl.kernel import KernelSet, select_kernels
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.layers import GatedMLP, ParallelLMHead, RMSNorm, RotaryEmbedding
from minisgl.plugins import PluginRegistry, UnknownComponentError
from minisgl.testing.kernels import KernelSetConformance

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the native CPU kernels are unavailable here")


class TestNativeKernelSet(KernelSetConformance):
    kernel_set = "native"


@needs_kernels
def test_auto_takes_native_for_float32_on_cpu_only(registry: PluginRegistry) -> None:
    assert [s.name for s in registry.ranked("kernels", "cpu")] == ["native", "torch"]
    assert isinstance(select_kernels("cpu", torch.float32, "auto", registry), NativeCPUKernels)
    assert isinstance(select_kernels(torch.device("cpu"), torch.float32, "native", registry), NativeCPUKernels)
    assert type(select_kernels("cpu", torch.bfloat16, "auto", registry)) is KernelSet  # the C kernels: float32 only
    assert type(select_kernels("cpu", torch.float32, "torch", registry)) is KernelSet
    assert type(select_kernels("meta", torch.float32, "auto", registry)) is KernelSet
    with pytest.raises(UnknownComponentError, match=r"kernel set 'native' cannot run torch.bfloat16 on cpu: .*float32"):
        select_kernels("cpu", torch.bfloat16, "native", registry)
    with pytest.raises(UnknownComponentError, match="kernel set 'native' does not support device 'cuda'"):
        select_kernels("cuda", torch.float32, "native", registry)


def _sets() -> list[KernelSet]:
    lib = load_cpu_kernels()
    if lib is None:
        pytest.skip("the native CPU kernels are unavailable here")
    return [KernelSet(), NativeCPUKernels(lib)]


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_layers_built_with_each_set_agree(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    outs = []
    for kernels in _sets():
        torch.manual_seed(0)
        tp, comm = TPInfo(), SingleCommunicator()
        norm = RMSNorm(48, 1e-6, kernels=kernels)
        norm.weight.data.uniform_(0.5, 1.5)
        mlp = GatedMLP(
            48, 96, "silu", tp=tp, comm=comm, dtype=torch.float32, device=torch.device("cpu"), kernels=kernels
        )
        head = ParallelLMHead(300, 48, tp=tp, comm=comm, kernels=kernels)
        for p in (*mlp.parameters(), head.weight):
            p.data.normal_(0, 0.1)
        rope = RotaryEmbedding(16, 64, {"rope_theta": 10000.0, "rope_type": "default"}, kernels=kernels)
        gen.manual_seed(rows)
        x, res = torch.randn(rows, 48, generator=gen), torch.randn(rows, 48, generator=gen)
        h, summed = norm.forward_with_residual(x, res)
        h = mlp(h)
        q, k = torch.randn(rows, 2, 16, generator=gen), torch.randn(rows, 1, 16, generator=gen)
        positions = torch.arange(rows) % 64
        rq, rk = rope(positions, q, k, (norm_q := RMSNorm(16), norm_q))
        pool = MHAKVPool(KVLayout(1, 16, 4, 1, 16, torch.float32, torch.device("cpu"), kernels))
        pool.store_kv(rk, rk * 2, torch.randperm(64, generator=gen)[:rows], 0)
        logits = head.compute_logits(h)
        tokens = Sampler(torch.device("cpu"), 0, kernels).sample(logits, _greedy_reqs(rows)).tokens
        outs.append((summed, h, rq, rk, pool.k_cache(0).clone(), pool.v_cache(0).clone(), logits, tokens))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _greedy_reqs(n: int) -> list[Req]:
    return [Req(rid=i, input_ids=[1], params=SamplingParams(temperature=0.0), max_new_tokens=1) for i in range(n)]
