"""The fused backend on CPU: alignment logic, plugin registration, and the Triton kernels in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from minisgl_plugin_qwen3_moe.align import align_torch, max_blocks

from minisgl.plugins import UnknownComponentError, load_plugins

HAS_TRITON = importlib.util.find_spec("triton") is not None


def random_ids(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, ::3] -= 100.0  # every third expert gets no token
    return torch.topk(logits, top_k, dim=-1).indices


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    [(1, 8, 1, 16), (1, 128, 8, 16), (5, 8, 2, 4), (37, 16, 4, 16), (300, 64, 8, 64), (64, 128, 8, 32)],
)
def test_alignment_invariants(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    ids = random_ids(tokens, experts, top_k, seed=tokens)
    flat = ids.reshape(-1)
    m = flat.numel()
    sorted_ids, block_expert = align_torch(ids, experts, block_m)
    assert block_expert.numel() == max_blocks(m, experts, block_m)
    assert sorted_ids.numel() == block_expert.numel() * block_m
    real = sorted_ids[sorted_ids < m]
    assert sorted(real.tolist()) == list(range(m))  # every assignment exactly once
    assert (sorted_ids[sorted_ids >= m] == m).all()  # padding holds the sentinel
    counts = torch.bincount(flat, minlength=experts)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert (block_expert[:used] >= 0).all() and (block_expert[used:] == -1).all()
    for b in range(used):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < m].long()
        assert rows.numel() > 0 and (flat[rows] == block_expert[b]).all()
    for e in range(experts):  # stable: an expert's assignments in token order, experts in ascending order
        assert real[flat[real.long()] == e].tolist() == torch.nonzero(flat == e).flatten().tolist()
    assert block_expert[:used].diff().ge(0).all()


def test_plugin_entry_does_not_import_triton() -> None:
    code = "import sys; from minisgl.plugins import load_plugins; load_plugins(); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_auto_picks_fused_on_cuda_and_torch_on_cpu() -> None:
    reg = load_plugins()
    assert "Qwen3MoeForCausalLM" in reg.names("model")
    assert reg.provider("moe", "fused").distribution == "minisgl-plugin-qwen3-moe"
    assert reg.pick("moe", "auto", "cpu").name == "torch"
    assert reg.pick("moe", "auto", "cuda").name == ("fused" if HAS_TRITON else "torch")
    with pytest.raises(UnknownComponentError, match="'fused' does not support device 'cpu'"):
        reg.pick("moe", "fused", "cpu")


INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from minisgl.moe import ExpertScales, TorchMoEBackend, route
    from minisgl_plugin_qwen3_moe.align import align_torch
    from minisgl_plugin_qwen3_moe.fp8 import quantize_experts
    from minisgl_plugin_qwen3_moe.fused_moe import align, fused_moe

    torch.manual_seed(0)
    # (tokens, experts, top_k, hidden, inter): K not a multiple of the K tile, N below the N tile, idle experts.
    for tokens, experts, top_k, hidden, inter in [(1, 8, 1, 96, 48), (5, 8, 2, 64, 32), (37, 16, 4, 64, 64),
                                                  (300, 8, 2, 32, 16)]:
        x = torch.randn(tokens, hidden)
        w13 = torch.randn(experts, 2 * inter, hidden) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter) / inter**0.5
        logits = torch.randn(tokens, experts)
        logits[:, -1] -= 100.0
        weights, ids = route(logits, top_k, True)
        for block_m in (16, 32):
            want = align_torch(ids, experts, block_m)
            got = align(ids, experts, block_m, "triton")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (tokens, block_m)
        ref = TorchMoEBackend().forward(x, w13, w2, weights, ids)
        for method in ("triton", "torch"):
            out = fused_moe(x, w13, w2, weights, ids, align_method=method)
            err = (out - ref).abs().max().item()
            assert err < 1e-5, (tokens, experts, top_k, method, err)
        # FP8 experts: per-row scales (None), blocks of 32 and 64 columns (partial last blocks; 64: two K tiles).
        for block in (None, 32, 64):
            q13, s13, d13 = quantize_experts(w13, block)
            q2, s2, d2 = quantize_experts(w2, block)
            ref = TorchMoEBackend().forward(x, d13, d2, weights, ids)
            out = fused_moe(x, q13, q2, weights, ids, scales=ExpertScales(s13, s2, block))
            err = (out - ref).abs().max().item()
            assert err < 1e-5, (tokens, experts, top_k, block, err)
    print("ok")
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_fused_kernels_in_triton_interpreter(tmp_path: Path) -> None:
    """The kernels' indexing and masking, run by Triton's CPU interpreter (float32) against the torch backend,
    with float and FP8 expert weights (FP8: against the torch backend on the de-quantized weights)."""
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip(
            f"Triton's interpreter cannot loop over scalar arguments with numpy {numpy.__version__} (needs < 2.3)"
        )
    script = tmp_path / "check.py"
    script.write_text(INTERPRETER_CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
