"""Where the decode time goes on the GPU: FlashInfer decode variants and a profile window of the real run.

Run on a CUDA machine from the repository root (minisgl, its plugins and minisgl-bench importable):

    python3 benchmarks/h200/gpu_probe.py attention          # decode kernel: page sizes x tensor cores
    PROBE_HEADS=32 PROBE_KV=bf16,fp8_e4m3 python3 benchmarks/h200/gpu_probe.py attention OUT_DIR  # 8B, FP8 KV
    python3 benchmarks/h200/gpu_probe.py window OUT_DIR [FIRST]  # profile steps FIRST..FIRST+20 (default 300)
    python3 benchmarks/h200/gpu_probe.py sampling OUT_DIR        # the triton sampler's kernel alone
    python3 benchmarks/h200/gpu_probe.py prefill OUT_DIR         # a mixed step's attention, bf16 and FP8 KV

``attention`` times FlashInfer's paged decode kernel alone (NHD with and without tensor cores, HND with them;
and TensorRT-LLM's XQA at page 16 unless PROBE_XQA=0), at the shapes of the offline benchmark
(Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, bf16) for batch 64 and 256 with 600..2000-token
contexts, and reports the KV bytes read per second. ``window`` runs the offline workload and profiles 20
decode steps in the middle of it (batch near 256): wall time per step against the device's kernel time
per step, and the kernels that take it. ``sampling`` times minisgl-plugin-triton's one-pass sampler on bf16
logits of the Qwen3 (151,936) and Llama-3 (128,256) vocabularies at batch 1..256: temperature rows with the
hardware's approximate logarithm (what runs) and with the exact one, greedy rows, and the PyTorch path it
replaces (softmax, exponential noise, argmax), against the time to read the logits once at the protocol's 4.3 TB/s.
``prefill`` times the attention of one mixed step of the offline workload at the 8B shapes (32 query / 8 KV
heads, page 16: 15 prompts of 450-650 new tokens and 0-125 decoding requests with 560-600-token contexts), as
FlashInfer's paged prefill runs it over a bf16 and an FP8 cache, beside its ragged prefill over the prompts'
own bf16 K/V (what a prompt with nothing cached could attend to without reading the cache back).
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def attention(hq: int = 16, kv_dtypes: tuple[str, ...] = ("bf16",)) -> list[dict]:
    import flashinfer

    dev = torch.device("cuda")
    hkv, d = 8, 128
    rows = []
    for bs in (64, 256):
        rng = random.Random(bs)
        lens = [rng.randint(600, 2000) for _ in range(bs)]
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device=dev)
        for ps in (1, 16, 64):
            counts = [-(-n // ps) for n in lens]
            pages = sum(counts)
            perm = torch.randperm(pages, device=dev).to(torch.int32) + 1  # scattered pages, like a used pool
            indptr = torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)
            last = torch.tensor([n - (c - 1) * ps for n, c in zip(lens, counts)], dtype=torch.int32)
            # NHD (the pool's layout) with and without tensor cores; HND (each page's tokens of one head
            # contiguous) with them, at pages of 16+: an FP8 row of one head is 128 bytes, half a bf16 row.
            variants = [(kv, tc, "NHD") for kv in kv_dtypes for tc in (False, True)]
            variants += [(kv, True, "HND") for kv in kv_dtypes] if ps > 1 else []
            for kv_name, tc, layout in variants:
                kv_dtype = torch.float8_e4m3fn if kv_name.startswith("fp8") else torch.bfloat16
                shape = (pages + 1, ps, hkv, d) if layout == "NHD" else (pages + 1, hkv, ps, d)
                k = torch.randn(shape, device=dev).to(kv_dtype)
                v = torch.randn(shape, device=dev).to(kv_dtype)
                ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tc)
                w.plan(indptr, perm, last, hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                us = _time_us(functools.partial(w.run, q, (k, v)))
                row = _row(q, lens, hkv, kv_name, kv_dtype, ps, us, tensor_cores=tc, layout=layout)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if ps in XQA_PAGE_SIZES and os.environ.get("PROBE_XQA", "1") != "0":
                for kv_name in kv_dtypes:
                    try:
                        row = _xqa(q, lens, counts, perm, ps, hkv, kv_name)
                    except Exception as exc:  # keep FlashInfer's rows: say what failed instead
                        row = {"batch": bs, "kv_dtype": kv_name, "page_size": ps, "kernel": "xqa", "error": repr(exc)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


XQA_PAGE_SIZES = (16,)  # the engine's default page size (each page size is another XQA build)


def _time_us(run: Callable[[], object], n: int = 50) -> float:
    """Microseconds per call of ``run`` (three warm-up calls, then ``n`` between two CUDA events)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def _row(
    q: torch.Tensor, lens: list[int], hkv: int, kv: str, kv_dtype: torch.dtype, ps: int, us: float, **kernel: object
) -> dict:
    """One timing: the batch's shape, the kernel's settings, and the KV bytes it read per second."""
    bs, hq, d = q.shape
    kv_bytes = sum(lens) * hkv * d * 2 * kv_dtype.itemsize
    return {"batch": bs, "q_heads": hq, "kv_dtype": kv, "page_size": ps, **kernel, "us": round(us, 1),
            "kv_tb_s": round(kv_bytes / us / 1e6, 2), "tokens": sum(lens)}  # fmt: skip


def _xqa(q: torch.Tensor, lens: list[int], counts: list[int], perm: torch.Tensor, ps: int, hkv: int, kv: str) -> dict:
    """TensorRT-LLM's XQA decode (what ``--attn flashinfer,trtllm-xqa`` decodes with) on the same pages."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    dev, (bs, _, d) = q.device, q.shape
    kv_dtype = torch.float8_e4m3fn if kv.startswith("fp8") else torch.bfloat16
    pages = int(perm.numel())
    k = torch.randn(pages + 1, ps, hkv, d, device=dev).to(kv_dtype)
    v = torch.randn(pages + 1, ps, hkv, d, device=dev).to(kv_dtype)
    tables = torch.zeros(bs, max(counts), dtype=torch.int32, device=dev)
    start = 0
    for i, c in enumerate(counts):
        tables[i, :c] = perm[start : start + c]
        start += c
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)

    def run() -> torch.Tensor:
        return trtllm_batch_decode_with_kv_cache(
            q, (k, v), ws, tables, seq_lens, max(lens), bmm1_scale=d**-0.5, kv_layout="NHD", backend="xqa"
        )

    return _row(q, lens, hkv, kv, kv_dtype, ps, _time_us(run), kernel="xqa")


def window(out_dir: Path, first: int = 300, steps: int = 20) -> dict:
    """Profile decode steps ``first .. first + steps`` of the offline workload."""
    from minisgl_bench.offline import CONFIG_DIR, gpu_workload
    from torch.profiler import ProfilerActivity, profile

    from minisgl import LLM, SamplingParams

    work = gpu_workload()
    llm = LLM(
        "qwen3-0.6b",
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        model_config=str(CONFIG_DIR / "qwen3-0.6b.json"),
        page_size=16,
        max_running_requests=256,
        chunked_prefill_size=8192,
        max_model_len=4096,
        cuda_graph_max_bs=256,
    )
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in work.output_lens]
    llm.generate(
        work.prompts[:8], [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16)] * 8, use_tqdm=False
    )
    sched = llm.scheduler
    original = sched.step
    state = {"n": 0, "prof": None, "t0": 0.0, "sizes": []}

    def step():
        i = state["n"]
        if i == first:
            torch.cuda.synchronize()
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        events = original()
        if first <= i < first + steps:
            state["sizes"].append(len(sched.running))
        if i == first + steps - 1:
            torch.cuda.synchronize()
            state["wall"] = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
        state["n"] = i + 1
        return events

    sched.step = step
    t0 = time.perf_counter()
    llm.generate(work.prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    prof = state["prof"]
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    (out_dir / "profile-window.txt").write_text(table)
    result = {
        "steps_profiled": steps,
        "first_step": first,
        "running": state["sizes"],
        "wall_ms_per_step": state["wall"] * 1000 / steps,
        "gpu_kernel_ms_per_step": gpu_us / 1000 / steps,
        "total_steps": state["n"],
        "total_seconds_with_profiler": total,
    }
    print(table[:5000])
    print(json.dumps(result))
    llm.close()
    return result


def _torch_sample(logits: torch.Tensor, inv_t: float, gen: torch.Generator) -> torch.Tensor:
    """The PyTorch path the one-pass sampler replaces (the engine's exponential race)."""
    probs = torch.softmax(logits.float() * inv_t, dim=-1)
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)


def prefill() -> list[dict]:
    """Microseconds per layer of a mixed step's attention (see the module's docstring)."""
    import flashinfer

    dev = torch.device("cuda")
    hq, hkv, d, ps = 32, 8, 128, 16
    rng = random.Random(0)
    rows = []
    for decoding in (0, 60, 125):
        new = [rng.randint(450, 650) for _ in range(15)] + [1] * decoding
        ctx = new[:15] + [rng.randint(560, 600) for _ in range(decoding)]
        counts = [-(-n // ps) for n in ctx]
        pages = sum(counts)
        perm = torch.randperm(pages, device=dev).to(torch.int32) + 1
        kv_indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        last = torch.tensor([n - (c - 1) * ps for n, c in zip(ctx, counts, strict=True)], dtype=torch.int32)
        qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(qo[-1]), hq, d, dtype=torch.bfloat16, device=dev)
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        row: dict = {"prompts": 15, "decoding": decoding, "new_tokens": int(qo[-1]), "cached_tokens": sum(ctx)}
        for name, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            k = torch.randn(pages + 1, ps, hkv, d, device=dev).to(kv_dtype)
            v = torch.randn(pages + 1, ps, hkv, d, device=dev).to(kv_dtype)
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
            w.plan(qo, kv_indptr, perm, last, hq, hkv, d, ps, causal=True, q_data_type=torch.bfloat16,
                   kv_data_type=kv_dtype)  # fmt: skip
            row[f"paged_{name}_us"] = round(_time_us(functools.partial(w.run, q, (k, v))), 1)
            del k, v
        # The prompts alone, over their own K/V (nothing cached): the ragged kernel, bf16.
        p_qo = qo[:16]
        kq = torch.randn(int(p_qo[-1]), hkv, d, dtype=torch.bfloat16, device=dev)
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")
        ragged.plan(p_qo, p_qo, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
        row["ragged_prompts_bf16_us"] = round(_time_us(functools.partial(ragged.run, q[: int(p_qo[-1])], kq, kq)), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sampling() -> list[dict]:
    """Microseconds per call of the triton sampler (see the module's docstring), one row per (vocab, batch)."""
    from minisgl_plugin_triton.sampling import gumbel_sample

    dev = torch.device("cuda")
    rows = []
    for vocab in (151936, 128256):
        for batch in (1, 32, 64, 128, 256):
            logits = (torch.randn(batch, vocab, device=dev) * 3).to(torch.bfloat16)
            temp = torch.full((batch,), 1 / 0.6, device=dev)
            greedy = torch.zeros(batch, device=dev)
            gen = torch.Generator(device=dev).manual_seed(0)
            draw = functools.partial(gumbel_sample, logits, seed=5)
            row = {"vocab": vocab, "batch": batch, "read_floor_us": round(batch * vocab * 2 / 4.3e6, 1)}
            row["fast_log_us"] = round(_time_us(functools.partial(draw, temp)), 1)
            row["exact_log_us"] = round(_time_us(functools.partial(draw, temp, fast_log=False)), 1)
            row["greedy_us"] = round(_time_us(functools.partial(draw, greedy)), 1)
            row["torch_us"] = round(_time_us(functools.partial(_torch_sample, logits, 1 / 0.6, gen)), 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    what = sys.argv[1]
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    first = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    # attention: PROBE_HEADS query heads (16: Qwen3-0.6B; 32: the 8B shapes) and PROBE_KV, the KV dtypes to time
    # (comma-separated: bf16, fp8_e4m3); the defaults keep the file name of the 0.6B bf16 probe.
    heads, kv = int(os.environ.get("PROBE_HEADS", "16")), tuple(os.environ.get("PROBE_KV", "bf16").split(","))
    if what in ("sampling", "prefill"):
        (out / f"gpu-probe-{what}.json").write_text(
            json.dumps(sampling() if what == "sampling" else prefill(), indent=1)
        )
        sys.exit(0)
    res = attention(heads, kv) if what == "attention" else window(out, first)
    tag = "" if (heads, kv) == (16, ("bf16",)) else f"-h{heads}-{'-'.join(kv)}"
    name = what + tag if what == "attention" else f"{what}-{first}"
    if what != "attention":
        (out / "profile-window.txt").rename(out / f"profile-window-{first}.txt")
    (out / f"gpu-probe-{name}.json").write_text(json.dumps(res, indent=1))
