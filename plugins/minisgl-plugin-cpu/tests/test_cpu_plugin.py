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
