"""Compile the XQA decode modules the plugin's GPU tests and benchmark use, all in one parallel ninja run.

FlashInfer compiles one XQA module per (dtype, page size, head_dim, query heads per KV
head) on first use, one at a time; building the whole list up front lets ninja use
every core. Later calls find the modules built (``~/.cache/flashinfer``) and only load them.

    python3 plugins/minisgl-plugin-trtllm/gpu/prebuild.py
"""

from __future__ import annotations

import sys
import time

import torch

# (dtype, page size, head_dim, query heads per KV head): the shapes of tests/test_trtllm_gpu.py
# (conformance kit, random batches, tiny Qwen3 and Llama models) and gpu/bench_decode.py.
XQA_SHAPES = [
    (torch.bfloat16, 16, 128, 1),
    (torch.bfloat16, 16, 128, 2),
    (torch.bfloat16, 16, 128, 4),
    (torch.bfloat16, 16, 64, 4),
    (torch.bfloat16, 64, 128, 2),
    (torch.float16, 16, 128, 2),
    (torch.bfloat16, 16, 256, 2),
]


def main() -> int:
    from flashinfer.jit.core import build_jit_specs
    from flashinfer.jit.xqa import gen_xqa_module

    specs = [gen_xqa_module(dt, dt, ps, d, group, False, dt) for dt, ps, d, group in XQA_SHAPES]
    t0 = time.perf_counter()
    try:
        build_jit_specs(specs, verbose=False)
    except Exception as exc:  # the tests then compile on demand (and report what fails)
        print(f"PREBUILD xqa failed after {time.perf_counter() - t0:.0f}s: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"PREBUILD xqa: {len(specs)} modules in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
