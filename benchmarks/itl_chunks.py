"""What a client's inter-token latency (ITL) is made of when one SSE chunk carries several tokens.

    python benchmarks/itl_chunks.py RECORD TRACE --tokenizer DIR [--vocab N] [--json OUT]

RECORD is a ``minisgl bench serve`` JSON, TRACE the step trace of the same server (``--trace``). The client's
ITL is the gap between two text chunks. The detokenizer sends text only once it is complete: a token that ends
inside a multi-byte character, or that the tokenizer cannot decode at all (dummy weights sample ids from the
model's whole vocabulary, which can be larger than the tokenizer's), is held back and leaves with the next
chunk. So a chunk gap is the sum of the server's gaps between several consecutive tokens.

Per run of RECORD this prints the client's ITL p50/p99 and its tokens per chunk (both measured), the server's
token gap p50/p99 (``minisgl bench steps``' figure: each step's interval once for every request that decodes in
it), and the
chunk gaps that those server gaps give when tokens are grouped as the detokenizer groups uniformly random ids
(``--vocab`` of them, the model's vocabulary; replayed through ``IncrementalDetokenizer`` with ``--tokenizer``).
If the simulated chunk ITL matches the measured one, the client's ITL tail is the chunking, and the server's
token gap is the figure that tells a slow step.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
from minisgl_bench.serve_trace import _run_name, read_trace
from minisgl_bench.steps_report import run_steps, summarize_steps
from transformers import AutoTokenizer

from minisgl.tokenizer.detokenize import IncrementalDetokenizer


def chunk_lengths(tokenizer: Any, vocab: int, tokens: int, seed: int = 0) -> list[int]:
    """Tokens per non-empty text piece when ``tokens`` uniformly random ids in ``[0, vocab)`` stream out."""
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer)
    lengths, pending = [], 0
    for _ in range(tokens):
        pending += 1
        if detok.push(rng.randrange(vocab)):
            lengths.append(pending)
            pending = 0
    return lengths


def simulate(steps: list[dict[str, Any]], lengths: list[int], samples: int, seed: int = 0) -> list[float]:
    """Chunk gaps in ms: a stream decoding from a step (drawn by its decoding requests) whose next chunk
    holds ``L`` tokens (drawn from ``lengths``) waits the ``L`` step intervals that follow."""
    t = np.array([float(s["t"]) for s in steps]) * 1000.0
    weights = np.array([float(s.get("decode_reqs", 0)) for s in steps[1:]])
    if len(t) < 2 or weights.sum() <= 0:
        return []
    rng = np.random.default_rng(seed)
    starts = rng.choice(len(weights), size=samples, p=weights / weights.sum())  # step index of a token's gap
    span = rng.choice(np.asarray(lengths), size=samples)
    ends = np.minimum(starts + span, len(t) - 1)
    return list(t[ends] - t[starts])


def _pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", type=Path)
    p.add_argument("trace", type=Path)
    p.add_argument("--tokenizer", required=True, help="the tokenizer folder the server used")
    p.add_argument("--vocab", type=int, default=None, help="ids sampled from [0, N): the model's vocabulary")
    p.add_argument("--tokens", type=int, default=20000, help="random ids replayed through the detokenizer")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    record = json.loads(args.record.read_text())
    _, steps = read_trace(args.trace)
    steps.sort(key=lambda s: s["t"])
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = args.vocab or len(tokenizer)
    lengths = chunk_lengths(tokenizer, vocab, args.tokens)
    result: dict[str, Any] = {
        "vocab": vocab,
        "tokens_per_chunk": {"mean": float(np.mean(lengths)), "p50": _pct(lengths, 50), "p99": _pct(lengths, 99)},
        "runs": {},
    }
    print(
        f"tokens per chunk, {args.tokens} random ids of {vocab}: mean {np.mean(lengths):.2f}, "
        f"p50 {_pct(lengths, 50):.0f}, p99 {_pct(lengths, 99):.0f}"
    )
    print(
        f"{'run':>14} {'tok/chunk':>9} {'client ITL p50/p99':>19} {'token gap p50/p99':>18} {'simulated p50/p99':>18}"
    )
    for run in record.get("runs", ()):
        window = run_steps(steps, run)
        gap = summarize_steps(window)["token_gap_ms"]
        sim = simulate(window, lengths, 200000)
        itl = run.get("itl_ms", {})
        row = {
            "tokens_per_chunk": run["total_output_tokens"] / run["text_chunks"] if run.get("text_chunks") else None,
            "client_itl_ms": {"p50": itl.get("p50"), "p99": itl.get("p99")},
            "token_gap_ms": {"p50": gap["p50"], "p99": gap["p99"]},
            "simulated_itl_ms": {"p50": _pct(sim, 50), "p99": _pct(sim, 99)},
        }
        result["runs"][_run_name(run)] = row

        def pair(d: dict[str, float | None]) -> str:
            return "/".join("-" if v is None else f"{v:.1f}" for v in (d["p50"], d["p99"]))

        per_chunk = "-" if row["tokens_per_chunk"] is None else f"{row['tokens_per_chunk']:.2f}"
        print(
            f"{_run_name(run):>14} {per_chunk:>9} {pair(row['client_itl_ms']):>19} "
            f"{pair(row['token_gap_ms']):>18} {pair(row['simulated_itl_ms']):>18}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
