"""The plugin's registration and support checks (everywhere), and what auto picks on CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from minisgl_plugin_triton import plugin

from minisgl.kernel import KernelSet, select_kernels
from minisgl.plugins import UnknownComponentError, Unsupported, load_plugins


def test_listed_and_ranked_above_torch_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = load_plugins(only=["builtin", "triton"], environ={})
    assert registry.provider("kernels", "triton").distribution == "minisgl-plugin-triton"
    assert [s.name for s in registry.ranked("kernels", "cpu")] == ["torch"]
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: object())
    assert [s.name for s in registry.ranked("kernels", "cuda")] == ["triton", "torch"]


def test_support_check_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Unsupported, match="CUDA only"):
        plugin.supported("cpu")
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Unsupported, match="pip install triton"):
        plugin.supported("cuda")


def test_cpu_keeps_the_torch_set_and_a_named_triton_is_refused() -> None:
    registry = load_plugins(only=["builtin", "triton"], environ={})
    assert type(select_kernels("cpu", torch.float32, "auto", registry)) is KernelSet
    with pytest.raises(UnknownComponentError, match="kernel set 'triton' does not support device 'cpu'"):
        select_kernels("cpu", torch.float32, "triton", registry)


def test_loading_the_plugin_imports_no_triton() -> None:
    code = (
        "import sys; from minisgl.plugins import load_plugins; load_plugins(only=['builtin', 'triton']); "
        "print('triton' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_picks_triton_on_cuda() -> None:
    from minisgl_plugin_triton.kernels import TritonKernels

    registry = load_plugins(only=["builtin", "triton"], environ={})
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert isinstance(select_kernels("cuda", dtype, "auto", registry), TritonKernels)
