"""Where a mixed step's time goes, against a decode step at the same batch (Qwen3-8B shape, dummy weights).

128 requests decode; then one long prompt is computed in chunks of CHUNK tokens beside them. For each phase:
wall ms per step (synchronized at the ends), the device's kernel time per step (torch profiler), and the host's
top functions (cProfile), and the host's split (ms per step, no profiler): the scheduler step, the attention
backend's metadata, its per-layer forward, the KV store inside it, the prefill graphs' replay and the sampler.
Usage: python3 mixed_probe.py CONFIG OUT_JSON [CHUNK]
"""

from __future__ import annotations

import cProfile
import io
import json
import os
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


class HostSplit:
    """Wall time spent inside chosen bound methods of live objects, accumulated per name (instance
    attributes shadow the methods, so nothing outside this probe changes)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner = getattr(obj, attr)
        self.ms[name] = 0.0

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ms[name] += (time.perf_counter() - t0) * 1000

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.ms = dict.fromkeys(self.ms, 0.0)


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    if os.environ.get("PROBE_STORE_OUTSIDE") == "1":  # the A/B of stores inside the prefill graphs' pieces
        from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

        FlashInferAttnBackend.supports_attend_stored = False
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
    result: dict = {
        "chunk": chunk,
        "decodes": len(sched.running),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MINISGL_", "PROBE_"))},
    }
    engine = llm.engine
    split = HostSplit()
    split.wrap(sched, "step", "scheduler_step")
    split.wrap(engine, "launch", "engine_launch")
    split.wrap(engine.attn, "prepare_metadata", "attn_prepare_metadata")
    split.wrap(engine.attn, "forward", "attn_forward")
    split.wrap(engine.kv_pool, "store_kv", "store_kv")
    split.wrap(engine.sampler, "sample", "sampler")
    if engine.prefill_graphs is not None:
        split.wrap(engine.prefill_graphs, "replay", "prefill_graph_replay")
    if engine.graphs is not None:
        split.wrap(engine.graphs, "replay", "decode_graph_replay")
    for phase in ("decode", "mixed"):
        if phase == "mixed":
            sched.add_request([rng.randint(0, 10000) for _ in range(chunk * 48)], SamplingParams(max_tokens=1))
            for _ in range(3):
                sched.step()
        wall = run_steps(sched, 20)
        split.reset()
        run_steps(sched, 20)
        host_split = {k: round(v / 20, 3) for k, v in split.ms.items()}
        print(phase, "host split ms/step:", host_split)
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
            "host_split_ms": host_split,
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
