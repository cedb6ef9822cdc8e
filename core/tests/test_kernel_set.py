"""select_kernels: which set each choice gives, and layers built with each set agree."""

from __future__ import annotations

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.distributed import SingleCommunicator, TPInfo
from minisgl.engine.sampling import Sampler
from minisgl.kernel import KernelSet, NativeCPUKernels, select_kernels
from minisgl.kernel.cpu import load_cpu_kernels
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.layers import GatedMLP, ParallelLMHead, RMSNorm, RotaryEmbedding

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the native CPU kernels are unavailable here")


def test_torch_choice_is_plain_pytorch_everywhere() -> None:
    for device, dtype in (("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.bfloat16)):
        kernels = select_kernels(device, dtype, "torch")
        assert type(kernels) is KernelSet and kernels.gumbel_sample is None


@needs_kernels
def test_auto_choice_on_cpu() -> None:
    assert isinstance(select_kernels("cpu", torch.float32), NativeCPUKernels)
    assert isinstance(select_kernels(torch.device("cpu"), torch.float32, "auto"), NativeCPUKernels)
    assert type(select_kernels("cpu", torch.bfloat16)) is KernelSet  # the C kernels are float32 only
    assert type(select_kernels("meta", torch.float32)) is KernelSet
    with pytest.raises(ValueError, match="unknown kernel set"):
        select_kernels("cpu", torch.float32, "triton")


def test_layers_default_to_auto_and_take_a_set() -> None:
    plain = KernelSet()
    assert RMSNorm(8, kernels=plain).kernels is plain
    assert type(RMSNorm(8).kernels) is type(select_kernels("cpu", torch.float32))
    assert MHAKVPool(KVLayout(1, 2, 4, 1, 8, torch.float32, torch.device("cpu"), plain)).kernels is plain
    assert Sampler(torch.device("cpu"), 0, plain).kernels is plain


def _sets() -> list[KernelSet]:
    native = select_kernels("cpu", torch.float32)
    if not isinstance(native, NativeCPUKernels):
        pytest.skip("the native CPU kernels are unavailable here")
    return [KernelSet(), native]


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
