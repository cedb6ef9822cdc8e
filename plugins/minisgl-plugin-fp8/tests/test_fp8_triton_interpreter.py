"""The Triton block GEMM on the CPU, through Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess):
its tiling, masks (K and N not multiples of the tiles) and scale indexing against the float32 W8A8 reference.
The interpreter's own float8 rounding is not the GPU's, so activations are quantized by PyTorch here and the
fused quantization kernel is checked for its scales only, as are the RMSNorm and SiLU x up that quantize their
output (with the error of their FP8 values); test_fp8_gpu.py covers them bit for bit on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton installed"),
]

SCRIPT = """
import json, torch
from minisgl_plugin_fp8 import kernels
from minisgl_plugin_fp8.reference import quantize_token_groups, quantize_tokens, reference_w8a8_linear
from minisgl_plugin_fp8.testing import quantize_weight
torch.manual_seed(0)
out = {"gemm": [], "scales": []}
for m, k, n, bias in [(7, 192, 320, False), (20, 256, 200, True), (1, 384, 64, False)]:
    w = torch.randn(n, k) * k**-0.5
    parts, _ = quantize_weight(w, "fp8-block")
    scale = parts["weight_scale_inv"].repeat_interleave(128, 0)[:n].contiguous()
    x = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    y = kernels.block_linear(x, parts["weight"], scale, 128, b)
    ref = reference_w8a8_linear(x, parts["weight"], scale, 128, b)
    out["gemm"].append([list(y.shape), float((y.float() - ref).norm() / ref.norm())])
x = torch.randn(7, 320, dtype=torch.bfloat16) * 3
for group in (None, 128):
    _, s = kernels._triton_quant(x, group)
    _, ref = quantize_tokens(x) if group is None else quantize_token_groups(x, group)
    out["scales"].append(float((s - ref).abs().max()))
out["fused"] = []
for rows, hidden, residual in [(5, 192, True), (3, 1000, False), (1, 256, True)]:
    x = torch.randn(rows, hidden, dtype=torch.bfloat16) * 2
    r = torch.randn(rows, hidden, dtype=torch.bfloat16) if residual else None
    w = torch.rand(hidden, dtype=torch.bfloat16) + 0.5
    got, res = kernels.add_rmsnorm_quant(x, r, w, 1e-6)
    summed = x if r is None else (x.float() + r.float()).to(torch.bfloat16)
    f = summed.float()
    y = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    y = (y.float() * w.float()).to(torch.bfloat16)
    _, ref_s = quantize_tokens(y)
    err = float((got.dequantize().float() - y.float()).norm() / y.float().norm())
    scale_err = float((got.scales / ref_s - 1).abs().max())
    out["fused"].append([list(got.values.shape), scale_err, bool(torch.equal(res, summed)), err])
for rows, n in [(4, 96), (2, 1000)]:
    gu = torch.randn(rows, 2 * n, dtype=torch.bfloat16) * 3
    gate, up = gu.float().chunk(2, dim=-1)
    y = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    got = kernels.silu_mul_quant(gu)
    _, ref_s = quantize_tokens(y)
    err = float((got.dequantize().float() - y.float()).norm() / y.float().norm())
    out["fused"].append([list(got.values.shape), float((got.scales / ref_s - 1).abs().max()), True, err])
print(json.dumps(out))
"""


def test_block_gemm_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [shape for shape, _ in result["gemm"]] == [[7, 320], [20, 200], [1, 64]]
    assert all(err < 0.02 for _, err in result["gemm"]), result  # bf16 output rounding is what is left
    assert result["scales"] == [0.0, 0.0]
    # The fused RMSNorm and SiLU x up: shapes, residual sum, per-token scales (the interpreter's float32 sums
    # may round the norm one bf16 step apart from PyTorch's) and the FP8 values' error against the 16-bit result.
    assert [shape for shape, *_ in result["fused"]] == [[5, 192], [3, 1000], [1, 256], [4, 96], [2, 1000]]
    for _, scale_err, residual_ok, value_err in result["fused"]:
        assert scale_err < 1e-2 and residual_ok and value_err < 0.05, result["fused"]
