"""Kernel-level comparison of attention backends at the benchmark protocol's shapes (one H200 call).

Qwen3-0.6B attention (``--shape`` for others): 16 query heads, 8 KV heads, head_dim 128, bf16, page size 16
(the engine's default), pages scattered at random over the pool. Cases:

- prefill: 16 fresh prompts of 100-1024 tokens; 8 requests extending a 256-768 token
  cached prefix by 100-400 tokens (chunked prefill / prefix-cache hits);
- decode: batch 64 and batch 256, contexts of 550-650 tokens.

Each backend runs each case through its minisgl interface (``prepare_metadata`` then
``forward``: K/V store plus attention, one layer). Times are CUDA-event means:
``eager`` is one ``forward`` launched from Python (host overhead included),
``graph`` is ``forward`` captured ten times in a CUDA graph and replayed (device time;
decode goes through the backend's own graph hooks, as the engine runs it). Each
output is compared with the first backend's. Prints a table; writes JSON.

    python plugins/minisgl-plugin-fa/gpu/bench_kernels.py --backends fa,flashinfer --out fa_bench.json
    python plugins/minisgl-plugin-fa/gpu/bench_kernels.py --backends flashinfer --warmup-only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from minisgl.attention import AttentionContext, BaseAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool

PAGE = 16
DTYPE = torch.bfloat16
MAX_REQS, MAX_SEQ = 256, 2048
GRAPH_CALLS = 10


@dataclass(frozen=True)
class Case:
    name: str
    phase: str
    specs: tuple[tuple[int, int], ...]  # (cached tokens, new tokens) per request


def protocol_cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    return [
        Case("prefill 16 x 100-1024", "prefill", tuple((0, rng.randint(100, 1024)) for _ in range(16))),
        Case(
            "extend 8 x (256-768 + 100-400)",
            "prefill",
            tuple((rng.randint(256, 768), rng.randint(100, 400)) for _ in range(8)),
        ),
        Case("decode bs64 ctx~600", "decode", tuple((rng.randint(549, 649), 1) for _ in range(64))),
        Case("decode bs256 ctx~600", "decode", tuple((rng.randint(549, 649), 1) for _ in range(256))),
    ]


def build_backend(name: str, ctx: AttentionContext) -> BaseAttnBackend:
    if name == "torch":
        from minisgl.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend(ctx)
    if name == "flashinfer":
        from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

        return FlashInferAttnBackend(ctx)
    from minisgl_plugin_fa.backend import FlashAttnBackend

    generation = {"fa": None, "fa2": 2, "fa3": 3, "fa4": 4}[name]
    return FlashAttnBackend(ctx, generation=generation)


class Workspace:
    """One layer's KV pool (random contents), minisgl's page table, pages scattered at random."""

    def __init__(self, device: str = "cuda", heads: tuple[int, int, int] = (16, 8, 128), seed: int = 0):
        dev = torch.device(device)
        self.dev = dev
        self.hq, self.hkv, self.d = heads
        num_pages = MAX_REQS * 700 // PAGE + 64
        self.layout = KVLayout(1, num_pages, PAGE, self.hkv, self.d, DTYPE, dev)
        self.pool = MHAKVPool(self.layout)
        self.pool._buffer.normal_()
        self.table = torch.zeros((MAX_REQS, MAX_SEQ), dtype=torch.int32, device=dev)
        self.rng = random.Random(seed)
        self.ctx = AttentionContext(
            self.hq, self.hkv, self.d, PAGE, self.pool, self.table, MAX_REQS, MAX_SEQ, DTYPE, dev
        )

    def batch(self, case: Case) -> Batch:
        free = list(range(1, self.layout.num_pages))
        self.rng.shuffle(free)
        reqs, locs = [], []
        for row, (cached, new) in enumerate(case.specs):
            total = cached + new
            pages = [free.pop() for _ in range(-(-total // PAGE))]
            slots = (torch.tensor(pages).view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)
            self.table[row, : slots.numel()] = slots.to(self.dev, torch.int32)
            req = Req(rid=row, input_ids=[0] * total, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, cached, total
            reqs.append(req)
            locs.append(slots[cached:total])
        out_loc = torch.cat(locs).to(self.dev)
        return Batch(reqs, case.phase, out_loc=out_loc, sample_mask=[True] * len(reqs))


def work_of(ws: Workspace, case: Case) -> tuple[float, float]:
    """(attention FLOPs, K/V bytes read) of one layer of ``case``."""
    flops = 0.0
    tokens_read = 0
    for cached, new in case.specs:
        pairs = new * cached + new * (new + 1) / 2  # causal: each new token sees the prefix and earlier new ones
        flops += 4 * ws.d * ws.hq * pairs
        tokens_read += cached + new
    return flops, tokens_read * ws.hkv * ws.d * 2 * DTYPE.itemsize


def _time(fn: Any, iters: int) -> float:
    """Mean milliseconds of ``fn()`` over ``iters`` back-to-back runs (CUDA events)."""
    if not torch.cuda.is_available():  # a CPU dry run of this script
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1000 * (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def inputs(ws: Workspace, case: Case) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch (pages placed at random) and q, k, v of ``case``: every backend gets the same."""
    batch = ws.batch(case)
    assert batch.out_loc is not None
    tokens = batch.out_loc.numel()
    gen = torch.Generator(device=ws.dev).manual_seed(len(case.specs))
    q = torch.randn(tokens, ws.hq * ws.d, device=ws.dev, dtype=DTYPE, generator=gen)
    k = torch.randn(tokens, ws.hkv * ws.d, device=ws.dev, dtype=DTYPE, generator=gen)
    v = torch.randn(tokens, ws.hkv * ws.d, device=ws.dev, dtype=DTYPE, generator=gen)
    return batch, q, k, v


def run_case(
    ws: Workspace,
    name: str,
    case: Case,
    data: tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor],
    warmup_only: bool,
) -> dict[str, Any]:
    backend = build_backend(name, ws.ctx)
    label = getattr(getattr(backend, "kernels", None), "label", name)
    batch, q, k, v = data
    batch.attn_metadata, batch.padded_size = None, 0
    t0 = time.perf_counter()
    backend.prepare_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)
    if ws.dev.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0  # includes any kernel compilation
    row: dict[str, Any] = {"case": case.name, "backend": name, "kernels": label, "first_call_s": round(first_s, 2)}
    row["output"] = out.float().clone()
    if warmup_only:
        return row
    row["eager_us"] = 1000 * _time(lambda: backend.forward(q, k, v, 0, batch), 30 if ws.dev.type == "cuda" else 1)
    try:
        row["graph_us"] = 1000 * _graph_time(backend, batch, q, k, v)
    except Exception as exc:  # report and go on: one failed capture must not hide the other numbers
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    flops, nbytes = work_of(ws, case)
    best = row.get("graph_us", row["eager_us"])
    row["tflops"] = round(flops / best / 1e6, 1)
    row["kv_read_tb_s"] = round(nbytes / best / 1e6, 2)
    return row


def _graph_time(backend: BaseAttnBackend, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Mean ms of one ``forward`` replayed from a CUDA graph of GRAPH_CALLS calls."""
    if batch.is_decode:
        # The engine's path: static buffers from the backend's hooks, refreshed by prepare_for_replay.
        bs = batch.size
        backend.init_capture_graph(MAX_SEQ, [bs])
        assert batch.out_loc is not None
        static = Batch([], "decode", out_loc=batch.out_loc.clone(), padded_size=bs)
        backend.prepare_for_capture(static)
        run_batch = static
    else:
        backend.prepare_metadata(batch)
        run_batch = batch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, 0, run_batch)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(GRAPH_CALLS):
            backend.forward(q, k, v, 0, run_batch)
    if batch.is_decode:
        batch.padded_size = batch.size
        backend.prepare_for_replay(batch)
    graph.replay()
    return _time(graph.replay, 10) / GRAPH_CALLS


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl-libs-base", "quack-kernels", "flashinfer-python", "flash-attn"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description="attention kernels at the protocol's shapes")
    p.add_argument("--backends", default="fa,flashinfer", help="comma-separated: fa, fa2, fa3, fa4, flashinfer, torch")
    p.add_argument("--device", default="cuda", help="cuda; cpu only dry-runs this script (with --backends torch)")
    p.add_argument("--cases", default="", help="comma-separated case numbers to run (default: all)")
    p.add_argument("--shape", default="16,8,128", help="query heads, KV heads, head_dim (default: Qwen3-0.6B)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--warmup-only", action="store_true", help="run each case once (compiles kernels), no timing")
    args = p.parse_args()
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    hq, hkv, d = (int(x) for x in args.shape.split(","))
    ws = Workspace(args.device, (hq, hkv, d))
    rows: list[dict[str, Any]] = []
    cases = protocol_cases()
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    for case in cases:
        first: torch.Tensor | None = None
        data = inputs(ws, case)
        for name in names:
            try:
                row = run_case(ws, name, case, data, args.warmup_only)
            except Exception as exc:
                row = {"case": case.name, "backend": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
            out = row.pop("output", None)
            if out is not None:
                if first is None:
                    first = out
                else:
                    row["rel_err_vs_" + names[0]] = float((out - first).norm() / first.norm())
            rows.append(row)
            print(json.dumps(row), flush=True)
    if not args.warmup_only:
        print(f"\n{'case':32s} {'backend':10s} {'eager us':>9s} {'graph us':>9s} {'TFLOP/s':>8s} {'KV TB/s':>8s}  note")
        for r in rows:
            note = r.get("error") or r.get("graph_error") or ""
            err = next((f"rel.err {v:.1e}" for key, v in r.items() if key.startswith("rel_err")), "")
            print(
                f"{r['case']:32s} {r['backend']:10s} {r.get('eager_us', float('nan')):9.1f} "
                f"{r.get('graph_us', float('nan')):9.1f} {r.get('tflops', float('nan')):8.1f} "
                f"{r.get('kv_read_tb_s', float('nan')):8.2f}  {err} {note}"
            )
    if args.out:
        device = torch.cuda.get_device_name() if ws.dev.type == "cuda" else platform.processor() or "cpu"
        doc = {"device": device, "versions": versions(), "shapes": {
            "q_heads": ws.hq, "kv_heads": ws.hkv, "head_dim": ws.d, "dtype": "bfloat16", "page_size": PAGE},
            "cases": [{"name": c.name, "phase": c.phase, "specs": c.specs} for c in cases],
            "results": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
