"""The conformance kit run against the cpu attention backend (native decode, per-request prefill)."""

from __future__ import annotations

import pytest
from minisgl_plugin_cpu.attention import CPUAttnBackend
from minisgl_plugin_cpu.native import load_cpu_kernels

from minisgl.plugins import PluginRegistry, load_plugins
from minisgl.testing.attention import AttentionBackendConformance

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the native CPU kernels are unavailable here")


class TestCPUBackendConformance(AttentionBackendConformance):
    backend = CPUAttnBackend

    def load_registry(self) -> PluginRegistry:
        return load_plugins(only=["builtin", "cpu"])
