"""What the plugin registers, where auto takes it, and an engine built with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from minisgl_plugin_cpu import attention, kernels

from minisgl import LLM
from minisgl.plugins import PluginRegistry


def test_ranked_above_the_torch_components_on_cpu_only(registry: PluginRegistry) -> None:
    for kind, name in (("attention", "cpu"), ("kernels", "native")):
        assert registry.provider(kind, name).distribution == "minisgl-plugin-cpu"
        if attention.load_cpu_kernels() is not None:
            assert [s.name for s in registry.ranked(kind, "cpu")] == [name, "torch"]
        assert [s.name for s in registry.ranked(kind, "cuda:0")] == ["torch"]
        assert registry.get(kind, name).unsupported_reason("cuda") == "runs on CPU only"
    assert registry.get("attention", "cpu").load_factory() is attention.CPUAttnBackend
    assert registry.get("kernels", "native").load_factory() is kernels.native_kernels


def test_loading_the_plugin_imports_no_torch() -> None:
    code = (
        "import sys; from minisgl.plugins import load_plugins; load_plugins(only=['builtin', 'cpu']); "
        "print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_an_engine_on_cpu_takes_both(tiny_dir, registry: PluginRegistry) -> None:
    if attention.load_cpu_kernels() is None:
        pytest.skip("the native CPU kernels are unavailable here")
    with LLM(str(tiny_dir), registry=registry, page_size=4) as llm:
        assert isinstance(llm.engine.kernels, kernels.NativeCPUKernels)
        assert llm.engine.attn_specs[0].name == "cpu"
    with LLM(str(tiny_dir), registry=registry, page_size=4, dtype="bfloat16") as llm:
        assert type(llm.engine.kernels).__name__ == "KernelSet"  # the C kernels are float32 only


def test_fp8_kv_cache_is_refused_by_name_and_auto_takes_torch(tiny_dir, registry: PluginRegistry) -> None:
    """The cpu backend reads only a float32 cache: asked for by name with an FP8 cache, start-up stops before the
    model loads and names the backend that can; under auto the torch reference runs, with the native kernels."""
    import threading

    from minisgl.core import ValidationError
    from minisgl.kvcache import KVLayout, MHAKVPool

    assert registry.get("attention", "cpu").kv_cache_dtypes == ()
    before = threading.active_count()
    with pytest.raises(
        ValidationError,
        match=r"kv_cache_dtype: attention backend 'cpu' cannot read a fp8_e4m3 KV cache; installed backends that "
        r"can: torch \(use --attn torch or --kv-cache-dtype auto",
    ):
        LLM(str(tiny_dir), registry=registry, attention_backend="cpu", kv_cache_dtype="fp8")
    assert threading.active_count() == before
    with LLM(str(tiny_dir), registry=registry, page_size=4, kv_cache_dtype="fp8_e4m3") as llm:
        assert llm.engine.attn_specs[0].name == "torch"
        out = llm.generate([[5, 6, 7, 8, 9]], use_tqdm=False)[0]
        assert len(out.token_ids) > 0
        llm.check_accounting()
    if attention.load_cpu_kernels() is not None:  # built directly over an FP8 pool, the backend refuses too
        import torch

        from minisgl.attention import AttentionContext

        pool = MHAKVPool(KVLayout(1, 4, 4, 2, 16, torch.float8_e4m3fn, torch.device("cpu")))
        ctx = AttentionContext(2, 2, 16, 4, pool, torch.zeros(1, 16, dtype=torch.int32), 1, 16, torch.float32,
                               torch.device("cpu"))  # fmt: skip
        with pytest.raises(ValueError, match="with a torch.float8_e4m3fn cache"):
            attention.CPUAttnBackend(ctx)
        # The native kernel set's store (float32 only) is bypassed for the pool's quantized bytes: same bytes.
        from dataclasses import replace

        layout = KVLayout(2, 5, 4, 2, 16, torch.float8_e4m3fn, torch.device("cpu"), k_scales=(0.5, 2.0))
        native = MHAKVPool(replace(layout, kernels=kernels.native_kernels(torch.device("cpu"), torch.float32)))
        plain = MHAKVPool(layout)
        kv = torch.randn(7, 2, 48) * 100
        loc = torch.tensor([3, 4, 9, 10, 11, 17, 18])
        for pool in (native, plain):
            pool.store_kv(kv[..., :16], kv[..., 16:32], loc, 1)
        assert torch.equal(native.k_cache(1).view(torch.uint8), plain.k_cache(1).view(torch.uint8))
        assert torch.equal(native.v_cache(1).view(torch.uint8), plain.v_cache(1).view(torch.uint8))
        assert native.k_cache(1).view(torch.uint8).any()
