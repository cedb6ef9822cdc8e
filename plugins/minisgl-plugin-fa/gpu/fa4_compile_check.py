"""Compile the FlashAttention 4 kernels the fa backend calls, without a GPU.

Runs the plugin's FA4 adapter (``minisgl_plugin_fa.kernels.FA4Kernels``) under
torch's FakeTensorMode, with FlashAttention told to target a GPU that is not
there (``FLASH_ATTENTION_ARCH``, ``CUTE_DSL_ARCH``, ``FLASH_ATTENTION_NUM_SMS``).
FlashAttention then checks the arguments and compiles each kernel exactly as it
would on that GPU, but launches nothing. This catches argument, layout and
compile errors on a machine without a GPU; it proves nothing about the numbers.

    python plugins/minisgl-plugin-fa/gpu/fa4_compile_check.py [--arch sm_90]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90", help="target, e.g. sm_90 (H100/H200) or sm_100 (B200)")
    p.add_argument("--num-sms", default="132")
    args = p.parse_args()
    os.environ["FLASH_ATTENTION_ARCH"] = args.arch
    os.environ["CUTE_DSL_ARCH"] = args.arch + "a"
    os.environ["FLASH_ATTENTION_NUM_SMS"] = args.num_sms

    import torch
    from minisgl_plugin_fa.kernels import FA4Kernels
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernels = FA4Kernels()
    failures = 0
    # (dtype, q heads, kv heads, head_dim, page_size): the shipped models' shapes and the test matrix.
    cases = [
        (torch.bfloat16, 16, 8, 128, 16),  # Qwen3-0.6B
        (torch.bfloat16, 16, 8, 128, 1),
        (torch.bfloat16, 4, 4, 64, 16),  # GQA 1:1
        (torch.bfloat16, 8, 4, 64, 1),
        (torch.bfloat16, 32, 8, 128, 16),  # GQA 4:1 (Llama-3-8B)
        (torch.bfloat16, 16, 2, 128, 16),  # GQA 8:1
        (torch.float16, 28, 4, 128, 16),  # GQA 7:1 (Qwen2.5-7B)
        (torch.float16, 9, 3, 64, 16),  # SmolLM2-135M
    ]
    with FakeTensorMode():
        for dtype, hq, hkv, d, ps in cases:
            label = f"{str(dtype).removeprefix('torch.')} {hq}/{hkv} heads d{d} page {ps}"
            kc = torch.empty(512, ps, hkv, d, dtype=dtype, device="cuda")
            vc = torch.empty_like(kc)
            batch, tokens = 4, 300
            # q as the model may hand it over: rows of the fused qkv projection, viewed per head.
            # (Fake CUDA tensors cannot be sliced on a machine without CUDA: build the views directly.)
            row = (hq + 2 * hkv) * d
            q = torch.empty_strided((tokens, hq, d), (row, d, 1), dtype=dtype, device="cuda")
            q_decode = torch.empty_strided((batch, hq, d), (row, d, 1), dtype=dtype, device="cuda")
            seqused = torch.empty(batch, dtype=torch.int32, device="cuda")
            cu_seqlens = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
            table = torch.empty(batch, 1024 // ps, dtype=torch.int32, device="cuda")
            for phase in ("prefill", "decode"):
                t0 = time.perf_counter()
                try:
                    if phase == "prefill":
                        out = kernels.prefill(q, kc, vc, table, seqused, cu_seqlens, 120, d**-0.5)
                        assert out.shape == (tokens, hq, d), out.shape
                    else:
                        out = kernels.decode(q_decode, kc, vc, table, seqused, d**-0.5)
                        assert out.shape == (batch, hq, d), out.shape
                    assert out.dtype == dtype
                    print(f"ok    {phase:7s} {label}: {time.perf_counter() - t0:.1f}s", flush=True)
                except Exception as exc:  # report every case, then fail
                    failures += 1
                    print(f"FAIL  {phase:7s} {label}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
