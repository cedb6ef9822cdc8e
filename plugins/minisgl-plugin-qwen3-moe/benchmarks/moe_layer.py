"""Benchmark (not a test): one MoE layer, ``fused`` against ``torch``, on a CUDA GPU.

Default shapes are Qwen3-30B-A3B's (128 experts, top-8, hidden 2048, expert
intermediate 768, bf16) with random weights and random routing. For each token
count it reports the time per layer of

* the ``torch`` backend (eager; it reads per-expert counts on the host, so it
  cannot be captured in a CUDA graph),
* the ``fused`` backend eager (host launch overhead included) and replayed from
  a CUDA graph (device time only), with its default tiles and the best of a few
  alternative tiles,

against the memory-bandwidth floor: the weights of every expert that receives a
token read once, plus the activations read and written once, at the copy rate
given by ``--copy-tbps`` (and the rate measured here, for reference).

``--fp8 block`` (scales per row and 128 input columns, as FP8 checkpoints store them) or ``--fp8 row`` also
times the fused backend on the same weights in FP8 (de-quantized tile by tile), beside bf16, against its own
floor (one byte per weight, plus the scales); both run on the FP8 weights de-quantized, so they compute the same.

    python plugins/minisgl-plugin-qwen3-moe/benchmarks/moe_layer.py --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

import torch
from minisgl_plugin_qwen3_moe.fp8 import quantize_experts
from minisgl_plugin_qwen3_moe.fused_moe import FusedMoEBackend, GemmConfig, MoEConfig, default_config
from triton.testing import do_bench, do_bench_cudagraph

from minisgl.moe import ExpertScales, route
from minisgl.moe.torch_backend import TorchMoEBackend

# Alternative tiles tried at every token count (the default is always measured too).
CANDIDATES = [
    MoEConfig(16, GemmConfig(64, 128, 1, 4, 4), GemmConfig(128, 128, 1, 4, 4)),
    MoEConfig(16, GemmConfig(32, 256, 1, 4, 3), GemmConfig(64, 256, 1, 4, 3)),
    MoEConfig(32, GemmConfig(64, 128, 4, 4, 3), GemmConfig(64, 128, 4, 4, 3)),
    MoEConfig(64, GemmConfig(64, 64, 8, 4, 3), GemmConfig(128, 64, 8, 8, 3)),
    MoEConfig(64, GemmConfig(128, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 4)),
    MoEConfig(128, GemmConfig(64, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 3)),
]


def candidates_for(tokens: int, top_k: int, experts: int) -> list[MoEConfig]:
    """Tiles whose block_m is at most 4x the mean rows per expert (larger blocks would be mostly padding)."""
    per_expert = max(tokens * top_k / experts, 1.0)
    return [c for c in CANDIDATES if c.block_m <= max(16, 4 * per_expert)]


def copy_rate_tbps(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e12  # bytes read + written


def graph_us(fn: Any) -> float:
    """Median time (us) of ``fn`` replayed from a CUDA graph; NaN, with the reason printed, if capture fails."""
    try:
        return 1e3 * do_bench_cudagraph(fn, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - a failed capture is a result to report, not a crash
        print(f"  CUDA graph capture failed: {exc!r}", flush=True)
        return float("nan")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_fp8(
    args: argparse.Namespace,
    row: dict[str, Any],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp8: tuple[torch.Tensor, torch.Tensor, ExpertScales],
    ref: torch.Tensor,
) -> None:
    """The fused backend on FP8 experts: error against ``ref`` (the de-quantized weights), graph time, floor."""
    q13, q2, scales = fp8
    be = FusedMoEBackend()
    out = be.forward(x, q13, q2, weights, ids, scales=scales)
    scale_bytes = (scales.w13[0].numel() + scales.w2[0].numel()) * 4
    weight_bytes = row["active_experts"] * (3 * args.hidden * args.inter + scale_bytes)
    row["fp8_floor_us"] = (weight_bytes + 2 * x.numel() * x.element_size()) / (args.copy_tbps * 1e12) * 1e6
    row["fp8_rel_error_vs_dequantized"] = rel_error(out, ref)
    row["fp8_graph_us"] = graph_us(lambda: be.forward(x, q13, q2, weights, ids, scales=scales))
    row["fp8_vs_bf16"] = row["fp8_graph_us"] / row["fused_graph_us"]


def bench_tokens(
    args: argparse.Namespace,
    tokens: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    fp8: tuple[torch.Tensor, torch.Tensor, ExpertScales] | None = None,
) -> dict[str, Any]:
    dev, dtype = w13.device, w13.dtype
    gen = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, args.hidden, device=dev, dtype=dtype, generator=gen)
    logits = torch.randn(tokens, args.experts, device=dev, generator=gen)
    weights, ids = route(logits, args.top_k, renormalize=True)
    active = int(ids.unique().numel())
    elem = w13.element_size()
    floor_bytes = active * 3 * args.hidden * args.inter * elem + 2 * tokens * args.hidden * elem
    flops = 2 * tokens * args.top_k * 3 * args.hidden * args.inter

    torch_be, fused_be = TorchMoEBackend(), FusedMoEBackend()
    ref = torch_be.forward(x, w13, w2, weights, ids)
    out = fused_be.forward(x, w13, w2, weights, ids)
    row: dict[str, Any] = {
        "tokens": tokens,
        "active_experts": active,
        "rel_error_fused_vs_torch": rel_error(out, ref),
        "floor_bytes": floor_bytes,
        "floor_us": floor_bytes / (args.copy_tbps * 1e12) * 1e6,
        "compute_floor_us": flops / (args.peak_tflops * 1e12) * 1e6,
        "torch_us": 1e3 * do_bench(lambda: torch_be.forward(x, w13, w2, weights, ids), return_mode="median"),
        "fused_eager_us": 1e3 * do_bench(lambda: fused_be.forward(x, w13, w2, weights, ids), return_mode="median"),
    }
    default = default_config(tokens * args.top_k, args.experts, dtype)
    row["default_config"] = repr(default)
    row["fused_graph_us"] = graph_us(lambda: fused_be.forward(x, w13, w2, weights, ids))
    best = (row["fused_graph_us"], repr(default))
    if args.sweep:
        for cfg in candidates_for(tokens, args.top_k, args.experts):
            if cfg == default:
                continue
            be = FusedMoEBackend(cfg)
            err = rel_error(be.forward(x, w13, w2, weights, ids), ref)
            us = graph_us(lambda be=be: be.forward(x, w13, w2, weights, ids))
            print(f"  tokens={tokens} {cfg}: {us:.1f} us (rel err {err:.2e})", flush=True)
            if err < 1e-2 and us < best[0]:
                best = (us, repr(cfg))
    row["best_graph_us"], row["best_config"] = best
    timed = row["fused_graph_us"] if row["fused_graph_us"] == row["fused_graph_us"] else row["fused_eager_us"]
    row["fused_vs_floor"] = timed / row["floor_us"]
    if fp8 is not None:
        bench_fp8(args, row, x, weights, ids, fp8, ref)
    return row


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"# MoE layer: `fused` vs `torch` ({a['experts']} experts, top-{a['top_k']}, hidden {a['hidden']}, "
        f"expert intermediate {a['inter']}, {a['dtype']})",
        "",
        f"- machine: {result['machine']}",
        f"- command: `{result['command']}`",
        f"- commit: {result['commit']}",
        f"- date: {result['date']}",
        f"- copy rate used for the floor: {a['copy_tbps']} TB/s "
        f"(measured here: {result['measured_copy_tbps']:.2f} TB/s)",
        "",
        "Times are medians in microseconds per layer. Floor: weights of the experts that receive a token, read once,",
        "plus activations in and out, at the copy rate. Graph: the fused layer replayed from a CUDA graph.",
        "",
        "| tokens | active experts | floor | torch | fused (eager) | fused (graph) | graph / floor "
        "| best tiles (graph) | rel. error |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['tokens']} | {r['active_experts']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} "
            f"| {r['fused_eager_us']:.1f} | {r['fused_graph_us']:.1f} | {r['fused_vs_floor']:.2f}x "
            f"| {r['best_graph_us']:.1f} | {r['rel_error_fused_vs_torch']:.1e} |"
        )
    if a.get("fp8") != "none":
        lines += [
            "",
            f"FP8 experts (`--fp8 {a['fp8']}`), the fused backend from a CUDA graph; both rows run the same "
            "(de-quantized) weights:",
            "",
            "| tokens | FP8 floor | bf16 (graph) | FP8 (graph) | FP8 / bf16 | FP8 / its floor | rel. error |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in result["rows"]:
            lines.append(
                f"| {r['tokens']} | {r['fp8_floor_us']:.1f} | {r['fused_graph_us']:.1f} | {r['fp8_graph_us']:.1f} "
                f"| {r['fp8_vs_bf16']:.2f}x | {r['fp8_graph_us'] / r['fp8_floor_us']:.2f}x "
                f"| {r['fp8_rel_error_vs_dequantized']:.1e} |"
            )
    lines += ["", "Default and best tiles per token count:", ""]
    for r in result["rows"]:
        lines.append(f"- {r['tokens']} tokens: default `{r['default_config']}`; best `{r['best_config']}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,64,512,4096")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--copy-tbps", type=float, default=4.3, help="copy rate for the floor (TB/s)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="matrix rate for the compute floor (TFLOP/s)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    ap.add_argument("--fp8", default="none", choices=["none", "block", "row"], help="also time FP8 experts")
    ap.add_argument("--commit", default=None, help="commit benchmarked (default: git rev-parse HEAD)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, device=dev, dtype=dtype, generator=gen)
    w13 *= args.hidden**-0.5
    w2 = torch.randn(args.experts, args.hidden, args.inter, device=dev, dtype=dtype, generator=gen) * args.inter**-0.5
    fp8 = None
    if args.fp8 != "none":  # every row then runs the de-quantized weights, so bf16 and FP8 compute the same
        block = 128 if args.fp8 == "block" else None
        q13, s13, w13 = quantize_experts(w13, block)
        q2, s2, w2 = quantize_experts(w2, block)
        fp8 = (q13, q2, ExpertScales(s13, s2, block))
    result: dict[str, Any] = {
        "machine": f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}",
        "command": "python plugins/minisgl-plugin-qwen3-moe/benchmarks/moe_layer.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k in ("tokens", "fp8"))
        + (" --sweep" if args.sweep else ""),
        "commit": args.commit or git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "measured_copy_tbps": copy_rate_tbps(dev),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [],
    }
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = bench_tokens(args, tokens, w13, w2, fp8)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        if args.json:  # written after every row, so a run cut short still leaves its results
            args.json.write_text(json.dumps(result, indent=2))
    if args.md:
        args.md.write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
