"""Decode attention on one GPU: TensorRT-LLM's XQA (``trtllm-xqa``) against the ``flashinfer`` plugin.

Qwen3-0.6B shapes (16 query heads, 8 KV heads, head_dim 128, bf16), page size 16,
batch 64 and 256, contexts of 550-650 tokens on randomly placed pages. Each
backend runs through its own minisgl interface (store K/V, then attend, for one
layer): eager, and replayed from a CUDA graph of 10 calls captured with the
backend's graph hooks (launch overhead gone: what the engine's decode sees).
Reports microseconds per call and the KV bytes read per second, and checks that
the backends agree.

    python3 plugins/minisgl-plugin-trtllm/gpu/bench_decode.py [--out FILE]
    python3 plugins/minisgl-plugin-trtllm/gpu/bench_decode.py --warmup-only   # compile FlashInfer's modules
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from minisgl.attention import AttentionContext, BaseAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool

HQ, HKV, D, PS, DTYPE = 16, 8, 128, 16, torch.bfloat16
MAX_SEQ = 1024
GRAPH_CALLS, REPLAYS, EAGER_CALLS = 10, 20, 50
Factory = Callable[[AttentionContext], BaseAttnBackend]


def backends() -> dict[str, Factory]:
    from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend
    from minisgl_plugin_trtllm.backend import TrtllmAttnBackend, build_xqa, flashinfer_kernels

    return {
        "flashinfer": FlashInferAttnBackend,  # tensor-core decode: the plugin's default at 2 query heads per KV head
        "flashinfer-cuda-cores": lambda ctx: FlashInferAttnBackend(ctx, use_tensor_cores=False),
        "trtllm-xqa": build_xqa,
        "trtllm-xqa-no-pdl": lambda ctx: TrtllmAttnBackend(
            ctx, flashinfer_kernels(with_context=False), decode="xqa", enable_pdl=False
        ),
    }


class Workload:
    """One layer's pool and page table holding ``bs`` requests of 550-650 tokens; a decode batch over them."""

    def __init__(self, bs: int, seed: int = 0):
        rng = random.Random(seed)
        self.dev = torch.device("cuda")
        self.lens = [rng.randint(550, 650) for _ in range(bs)]
        pages_needed = sum(-(-n // PS) for n in self.lens)
        num_pages = pages_needed + 64
        self.pool = MHAKVPool(KVLayout(1, num_pages, PS, HKV, D, DTYPE, self.dev))
        self.pool._buffer.normal_()
        self.table = torch.zeros(bs, MAX_SEQ, dtype=torch.int32, device=self.dev)
        free = list(range(1, num_pages))
        rng.shuffle(free)
        reqs, locs = [], []
        for row, n in enumerate(self.lens):
            pages = torch.tensor([free.pop() for _ in range(-(-n // PS))])
            slots = (pages.view(-1, 1) * PS + torch.arange(PS)).view(-1).to(torch.int32)
            self.table[row, : slots.numel()] = slots.to(self.dev)
            req = Req(rid=row, input_ids=[0] * n, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, n - 1, n
            reqs.append(req)
            locs.append(slots[n - 1 : n].long())
        self.reqs, self.out_loc = reqs, torch.cat(locs).to(self.dev)
        self.ctx = AttentionContext(HQ, HKV, D, PS, self.pool, self.table, bs, MAX_SEQ, DTYPE, self.dev)
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        self.q = torch.randn(bs, HQ * D, device=self.dev, dtype=DTYPE, generator=gen)
        self.k = torch.randn(bs, HKV * D, device=self.dev, dtype=DTYPE, generator=gen)
        self.v = torch.randn(bs, HKV * D, device=self.dev, dtype=DTYPE, generator=gen)

    def batch(self) -> Batch:
        return Batch(list(self.reqs), "decode", out_loc=self.out_loc, sample_mask=[True] * len(self.reqs))

    @property
    def kv_bytes(self) -> int:
        return sum(self.lens) * HKV * D * 2 * DTYPE.itemsize


def elapsed_us(fn: Callable[[], object], repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000


def measure(
    name: str, factory: Callable[[AttentionContext], BaseAttnBackend], w: Workload
) -> tuple[dict, torch.Tensor]:
    backend = factory(w.ctx)
    bs = len(w.lens)
    batch = w.batch()
    backend.prepare_metadata(batch)
    out = backend.forward(w.q, w.k, w.v, 0, batch).clone()
    eager = elapsed_us(lambda: backend.forward(w.q, w.k, w.v, 0, batch), EAGER_CALLS) / EAGER_CALLS

    backend.init_capture_graph(MAX_SEQ, [bs])
    static = Batch([], "decode", out_loc=w.out_loc.clone(), padded_size=bs)
    backend.prepare_for_capture(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(w.q, w.k, w.v, 0, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(GRAPH_CALLS):
            graph_out = backend.forward(w.q, w.k, w.v, 0, static)
    replay_batch = w.batch()
    replay_batch.padded_size = bs
    backend.prepare_for_replay(replay_batch)
    graph.replay()
    graphed = elapsed_us(graph.replay, REPLAYS) / (REPLAYS * GRAPH_CALLS)
    err = float((graph_out.float() - out.float()).norm() / out.float().norm())
    assert err < 1e-3, f"{name}: the graph replay differs from the eager call ({err:.2e})"
    row = {
        "backend": name,
        "batch": bs,
        "tokens": sum(w.lens),
        "eager_us": round(eager, 1),
        "graph_us": round(graphed, 1),
        "kv_tb_s": round(w.kv_bytes / graphed / 1e6, 2),
    }
    return row, out


def warmup_only() -> int:
    """Run FlashInfer's decode (both kernels) and prefill once, so that their modules get compiled."""
    from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

    w = Workload(4)
    for tc in (True, False):
        backend = FlashInferAttnBackend(w.ctx, use_tensor_cores=tc)
        batch = w.batch()
        backend.prepare_metadata(batch)
        backend.forward(w.q, w.k, w.v, 0, batch)
        prefill = Batch(list(w.reqs), "prefill", out_loc=w.out_loc, sample_mask=[True] * 4)
        backend.prepare_metadata(prefill)
        backend.forward(w.q, w.k, w.v, 0, prefill)
    torch.cuda.synchronize()
    print("WARMUP flashinfer decode (tensor cores and CUDA cores) and prefill: done", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--warmup-only", action="store_true", help="only compile FlashInfer's modules")
    args = p.parse_args()
    if args.warmup_only:
        return warmup_only()
    rows = []
    for bs in (64, 256):
        w = Workload(bs, seed=bs)
        outs = {}
        for name, factory in backends().items():
            try:
                row, outs[name] = measure(name, factory, w)
            except Exception as exc:  # report and go on with the other backends
                print(f"BENCH {name} batch {bs} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            if "flashinfer" in outs and name != "flashinfer":
                ref = outs["flashinfer"].float()
                row["rel_err_vs_flashinfer"] = float(f"{float((outs[name].float() - ref).norm() / ref.norm()):.2e}")
            rows.append(row)
            print("BENCH " + json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
