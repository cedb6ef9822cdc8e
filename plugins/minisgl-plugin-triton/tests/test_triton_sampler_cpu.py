"""The Triton sampler without a GPU: its noise and its loops in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
in a subprocess), and the kernel compiled for sm_90 by Triton's own compiler and ptxas (no GPU needed), where the
noise's logarithms must be the hardware's approximate ones. The draws' distribution on a GPU, with those
logarithms: test_triton_kernels_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton installed")

# Kernels (Triton compiles only functions written in files) that store the noise the sampler makes of Philox's
# words (and the words), or of given words; a driver printing JSON.
NOISE_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np, torch, triton, triton.language as tl
    from minisgl_plugin_triton.sampling import _noise

    @triton.jit
    def noise_kernel(r_ptr, n_ptr, seed, N: tl.constexpr):
        offs = tl.arange(0, N)
        r0, r1, r2, r3 = tl.randint4x(seed, offs)
        for i, r in ((0, r0), (1, r1), (2, r2), (3, r3)):
            tl.store(r_ptr + i * N + offs, r.to(tl.int32, bitcast=True))
            tl.store(n_ptr + i * N + offs, _noise(r, False))

    @triton.jit
    def given_kernel(r_ptr, n_ptr, count, B: tl.constexpr):
        offs = tl.arange(0, B)
        r = tl.load(r_ptr + offs, mask=offs < count, other=0).to(tl.uint32, bitcast=True)
        tl.store(n_ptr + offs, _noise(r, False), mask=offs < count)

    n = 1 << 16
    r = torch.empty(4 * n, dtype=torch.int32)
    noise = torch.empty(4 * n, dtype=torch.float32)
    noise_kernel[(1,)](r, noise, 1234, N=n)
    # Given words: 0 and the largest (the clamps), and both sides of the series' threshold (w = 2**-7).
    edge = np.array([0, 1, 2**25 - 4, 2**25 + 8, 2**31, 2**32 - 1], dtype=np.uint64)
    edge_noise = torch.empty(len(edge), dtype=torch.float32)
    given_kernel[(1,)](torch.from_numpy(edge.astype(np.uint32).view(np.int32)), edge_noise, len(edge), B=8)
    words = np.concatenate([r.numpy().view(np.uint32).astype(np.float64), edge.astype(np.float64)])
    got = np.concatenate([noise.numpy(), edge_noise.numpy()]).astype(np.float64)
    w = (words * 2.0**-32).astype(np.float32).astype(np.float64)  # the kernel's w, rounded to float32 as there
    exact = -np.log2(np.maximum(-np.log1p(-np.minimum(w, 1 - 2.0**-24)), 2.0**-32))
    e = np.sort(np.exp2(-got[: 4 * n]))  # the exponential variates the drawn noise stands for
    ks = float(np.max(np.abs((1 - np.exp(-e)) - np.arange(1, 4 * n + 1) / (4 * n))))
    print(json.dumps({
        "max_err": float(np.max(np.abs(got - exact))), "ks": ks, "n": 4 * n, "mean": float(e.mean()),
        "below_1e-3": int((e < 1e-3).sum()), "edge": edge_noise.tolist(),
    }))
    """
)

SAMPLE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from minisgl_plugin_triton.sampling import CHUNK, gumbel_sample
    torch.manual_seed(0)
    vocab = CHUNK + 905  # two chunks, the second partial
    logits = torch.randn(12, vocab).to(torch.bfloat16)
    logits[3, [17, CHUNK + 2]] = 50.0  # a tie across the chunks: the lower index, as torch.argmax
    logits[4, :] = float("-inf")
    logits[4, CHUNK + 9] = 0.0  # one finite entry, in the second chunk
    logits[5, :40] = float("nan")  # NaN is never taken
    greedy = gumbel_sample(logits, torch.zeros(12), seed=3)
    want = logits.float().nan_to_num(nan=float("-inf")).argmax(-1)
    # Sampled rows: the mass on four tokens in both chunks, everything else -inf; 16 rows per seed.
    hot = [5, CHUNK - 1, CHUNK, vocab - 1]
    row = torch.full((vocab,), float("-inf"))
    row[hot] = 0.0
    inv = torch.full((16,), 1 / 0.6)
    draws = [gumbel_sample(row.expand(16, vocab), inv, seed=s).tolist() for s in (7, 7, 8)]
    print(json.dumps({"greedy": greedy.tolist(), "want": want.tolist(), "draws": draws, "hot": hot}))
    """
)


def _interpret(script: str, tmp_path: Path) -> dict:
    path = tmp_path / "check.py"
    path.write_text(script)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_noise_is_exact_exponential_noise_in_the_interpreter(tmp_path: Path) -> None:
    """With the exact logarithms the noise is ``-log2(-ln(1 - w))`` of each Philox word (float64 reference, the
    series branch included), and 262,144 draws of it look exponential (Kolmogorov-Smirnov, mean, lower tail)."""
    result = _interpret(NOISE_SCRIPT, tmp_path)
    assert result["max_err"] < 2e-5, result  # float32 arithmetic; the series is exact to ~1e-7 relative
    n = result["n"]
    assert result["ks"] < 1.95 / n**0.5, result  # the 0.1 % critical value
    assert abs(result["mean"] - 1) < 5 / n**0.5, result
    # P(E < 1e-3) = 1e-3: 262 expected; a sampler that lost the tail's digits would bunch or miss them.
    assert abs(result["below_1e-3"] - n * 1e-3) < 5 * (n * 1e-3) ** 0.5, result
    edge = result["edge"]
    assert edge[0] == pytest.approx(32.0)  # w == 0: the finest E, 2**-32, not an infinite score
    assert edge[-1] == pytest.approx(-4.05, abs=0.01)  # w rounds to 1: E capped at -ln(2**-24), not +inf
    assert all(a >= b for a, b in zip(edge, edge[1:], strict=False)), edge  # larger w, less noise
    assert edge[2] - edge[3] == pytest.approx(0, abs=1e-5)  # the series and the logarithm meet at w = 2**-7


def test_greedy_rows_and_draws_in_the_interpreter(tmp_path: Path) -> None:
    """Greedy rows are torch.argmax (ties to the lower index across chunks, -inf and NaN never taken); sampled
    rows draw only tokens with finite logits, the same ones for the same seed."""
    result = _interpret(SAMPLE_SCRIPT, tmp_path)
    assert result["greedy"] == result["want"]
    assert result["greedy"][3] == 17
    first, again, other = result["draws"]
    assert set(first) <= set(result["hot"]) and set(other) <= set(result["hot"])
    assert first == again and first != other
    assert len(set(first)) > 1  # 16 draws from four equal tokens


def _tools() -> Path:
    """The NVIDIA backend's binaries that Triton's wheel carries (ptxas, nvdisasm)."""
    return Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin"  # type: ignore[union-attr, arg-type]


def _sass(fast: bool) -> str:
    """The first pass compiled for an H100/H200 (sm_90) and disassembled: Triton's compiler and the ptxas and
    nvdisasm its wheel carries, no GPU."""
    import triton
    from minisgl_plugin_triton import sampling
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {"CHUNK": sampling.CHUNK, "BLOCK": sampling.BLOCK, "Q": sampling.BLOCK // 4, "FAST": fast}
    signature = {
        **dict.fromkeys(["logits_ptr"], "*bf16"),
        **dict.fromkeys(["inv_temp_ptr", "best_ptr"], "*fp32"),
        "best_idx_ptr": "*i32",
        **dict.fromkeys(["vocab", "stride", "num_chunks", "seed"], "i32"),
        **dict.fromkeys(consts, "constexpr"),
    }
    # As the launcher specialises them for Qwen3's vocabulary (151,936): pointers and sizes divisible by 16.
    aligned = ["logits_ptr", "inv_temp_ptr", "best_ptr", "best_idx_ptr", "vocab", "stride"]
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=sampling._gumbel_chunk_kernel, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": sampling.WARPS})
    tools = _tools()
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"minisgl-gumbel-{os.getpid()}-{fast}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        return subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    finally:
        cubin.unlink()


def _loop_bodies(sass: str) -> list[list[str]]:
    """The instructions from each label to a conditional branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):", line))}
    bodies = []
    for i, line in enumerate(lines):
        m = re.search(r"@!?U?P\w+\s+BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            bodies.append(lines[labels[m.group(1)] : i + 1])
    return bodies


def test_the_gpu_kernel_takes_the_hardware_logarithm() -> None:
    """On the GPU the noise's two logarithms are MUFU.LG2 (one instruction each); the exact ones compile to
    polynomials instead. Compiled, not run: it needs Triton's NVIDIA backend tools, not a GPU."""
    tools = _tools()
    if not (tools / "ptxas").exists() or not (tools / "nvdisasm").exists():
        pytest.skip("this Triton carries no ptxas/nvdisasm")
    fast, exact = _sass(True), _sass(False)
    assert fast.count("MUFU.LG2") >= 8  # two per logit, unrolled over the block's quarters
    assert "MUFU.LG2" not in exact
    # Inside the loops, no barrier: the loads and the noise share one layout (sampling.WARPS); the final
    # reductions across warps have theirs.
    loops = _loop_bodies(fast)
    assert loops and not any("BAR.SYNC" in line for body in loops for line in body)
