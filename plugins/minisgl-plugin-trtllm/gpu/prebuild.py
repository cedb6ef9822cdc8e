"""Compile the XQA decode modules the plugin's GPU tests and benchmark use, all at once.

FlashInfer compiles one XQA module per (dtype, page size, head_dim, query heads per KV
head) on first use, one at a time, each from a few large CUDA files. Building every
module of the list concurrently (one ninja per module, so one failure stops no other)
keeps the machine's cores busy. Later calls find the modules built (``~/.cache/flashinfer``)
and only load them. FlashInfer runs every module's ninja in one folder, so concurrent ninjas share
its build log (``.ninja_log``); one that finds the log being rewritten by another fails at once
("opening build log"), so each module that fails is built again alone once the others are done.

    python3 plugins/minisgl-plugin-trtllm/gpu/prebuild.py          # every shape below
    python3 plugins/minisgl-plugin-trtllm/gpu/prebuild.py fp8      # only those over an FP8 cache
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

# (dtype, KV dtype, page size, head_dim, query heads per KV head): the shapes of tests/test_trtllm_gpu.py
# (conformance kit, random batches, tiny Qwen3 and Llama models), gpu/bench_decode.py and
# benchmarks/h200/gpu_probe.py (xqa rows).
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
XQA_SHAPES = [
    (BF16, BF16, 16, 128, 1),
    (BF16, BF16, 16, 128, 2),
    (BF16, BF16, 16, 128, 4),
    (BF16, BF16, 16, 64, 4),
    (BF16, BF16, 64, 128, 2),
    (FP16, FP16, 16, 128, 2),
    (BF16, BF16, 16, 256, 2),
    (BF16, FP8, 16, 128, 4),  # FP8 cache: conformance kit, random batches, the 8B probe
    (BF16, FP8, 16, 128, 2),  # FP8 cache: the tiny Qwen3 model
]


def main() -> int:
    from flashinfer.jit.xqa import gen_xqa_module

    def build(shape: tuple[torch.dtype, torch.dtype, int, int, int]) -> tuple[bool, str]:
        dt, kv, ps, d, group = shape
        t0 = time.perf_counter()
        try:
            gen_xqa_module(dt, kv, ps, d, group, False, dt).build(verbose=False)
        except Exception as exc:  # the tests then compile it on demand and report what fails
            return False, f"FAILED after {time.perf_counter() - t0:.0f}s: {type(exc).__name__}: {exc}".rstrip()
        return True, f"built in {time.perf_counter() - t0:.0f}s"

    shapes = [s for s in XQA_SHAPES if s[1] == FP8] if sys.argv[1:] == ["fp8"] else XQA_SHAPES
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(shapes)) as pool:
        results = list(pool.map(build, shapes))
    for i, shape in enumerate(shapes):  # again, one at a time: no other ninja shares the build log now
        if not results[i][0]:
            ok, again = build(shape)
            results[i] = ok, f"{results[i][1]}; alone: {again}"
    for shape, (_, line) in zip(shapes, results, strict=True):
        print(f"PREBUILD xqa {shape} {line}", flush=True)
    built = sum(ok for ok, _ in results)
    print(f"PREBUILD xqa: {built} of {len(results)} modules in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0 if built == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
