"""Registration: the method is listed with the quant_method values it reads, auto finds it for both layouts,
and the entry module imports no torch."""

from __future__ import annotations

import subprocess
import sys

from minisgl.plugins import choose_quantization, load_plugins
from minisgl.plugins.listing import to_json


def test_listed_with_what_it_reads_and_chosen_from_the_checkpoint() -> None:
    registry = load_plugins(only=["builtin", "fp8"], environ={})
    row = next(r for r in to_json(registry, device="cpu")["components"]["quantization"] if r["name"] == "fp8")
    assert (row["distribution"], row["quant_methods"], row["supported"]) == (
        "minisgl-plugin-fp8",
        ["fp8", "compressed-tensors"],
        True,
    )
    for method in ("fp8", "compressed-tensors"):
        assert choose_quantization(registry, "auto", {"quant_method": method}, "cuda").spec.name == "fp8"
    assert choose_quantization(registry, "auto", None, "cpu").spec.name == "none"
    assert choose_quantization(registry, "fp8", None, "cpu").config is None  # quantize at load


def test_the_entry_module_imports_no_torch() -> None:
    code = "import sys, minisgl_plugin_fp8.plugin; print('torch' in sys.modules, 'triton' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.split() == ["False", "False"]
