"""Where a mixed step's time goes, against a decode step at the same batch (Qwen3-8B shape, dummy weights).

128 requests decode; then one long prompt is computed in chunks of CHUNK tokens beside them. For each phase:
wall ms per step (synchronized at the ends), the device's kernel time per step (torch profiler), and the host's
top functions (cProfile). Usage: python3 mixed_probe.py CONFIG OUT_JSON [CHUNK]
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams


def run_steps(sched, n: int) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        sched.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / n


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 160
    llm = LLM(
        "probe", load_format="dummy", hf_config_path=config, device="cuda", dtype="bfloat16",
        schedule_policy="fcfs", chunked_prefill_size=chunk, max_model_len=8192,
    )  # fmt: skip
    sched = llm.scheduler
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=3000)
    for _ in range(128):
        sched.add_request([rng.randint(0, 10000) for _ in range(512)], params)
    while any(not r.output_ids for r in sched.running) or sched.waiting:
        sched.step()
    for _ in range(10):
        sched.step()
    result: dict = {"chunk": chunk, "decodes": len(sched.running)}
    for phase in ("decode", "mixed"):
        if phase == "mixed":
            sched.add_request([rng.randint(0, 10000) for _ in range(chunk * 48)], SamplingParams(max_tokens=1))
            for _ in range(3):
                sched.step()
        wall = run_steps(sched, 20)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_steps(sched, 10)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        device_us = sum(e.self_device_time_total for e in kernels) / 10
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
        cp = cProfile.Profile()
        cp.enable()
        run_steps(sched, 10)
        cp.disable()
        s = io.StringIO()
        pstats.Stats(cp, stream=s).sort_stats("cumulative").print_stats(45)
        result[phase] = {
            "wall_ms": wall,
            "device_kernel_ms": device_us / 1000,
            "top_kernels": [(e.key[:90], round(e.self_device_time_total / 10 / 1000, 3), e.count // 10) for e in top],
            "host_profile": s.getvalue()[-9000:],
        }
        print(phase, f"wall {wall:.2f} ms/step, kernels {device_us / 1000:.2f} ms/step")
        for row in result[phase]["top_kernels"]:
            print("   ", row)
        print(s.getvalue()[:6000])
    for r in list(sched.running) + list(sched.waiting):
        sched.abort(r.rid)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
