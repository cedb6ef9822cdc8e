"""Time each FP8 GEMM path against the bf16 matmul at Qwen3-8B's linear shapes (CUDA).

    python plugins/minisgl-plugin-fp8/gpu/bench_gemm.py --out fp8-gemm.json [--m 1,16,64,256,2048,8192] [--graph]

Paths: ``bf16`` (``F.linear``, the unquantized baseline), ``scaled_mm`` (per-token x per-channel through
``torch._scaled_mm``, activation quantization included), ``block`` (the Triton block kernel, 128x128 weight
blocks, activation quantization included), ``dequant`` (de-quantize then bf16 matmul, the fallback), the
load-time tuning's other candidates (``scaled_mm_fast``, ``tensor_epi``, ``w8a8``, ``weight_only`` /
``weight_only_block``: see kernels.py; ``--sweep`` adds the W8A8 tiles the tuning tries as
``w8_<BM>_<BN>_<BK>_w<warps>_s<stages>`` and weight-only tiles as ``wo_<BLOCK_N>_w<warps>_s<stages>``),
``gemm_rowwise`` / ``gemm_tensor`` (``torch._scaled_mm`` alone on activations quantized beforehand, row-wise
or per-tensor scales) and ``gemm_rowwise_fast`` / ``gemm_tensor_fast`` (the same with ``use_fast_accum``),
``fi_bmm_fp8`` / ``fi_blockscale_sm90`` (FlashInfer's, with ``--flashinfer``, where its build has them) and
``scaled_mm_1x128`` (torch's own 1x128 x 1x128 block-scaled ``_scaled_mm``, where this torch build has it).
Each is timed with CUDA events (median of ``--iters`` after ``--warmup``; with ``--graph``, each timing replays
a CUDA graph of 20 calls, which leaves out the host's launch cost as the engine's decode graphs do, and is
divided by 20) and reported with TFLOP/s
(``2 M N K`` per call) and its relative error against float32 of the de-quantized weights. Prints a table
and writes JSON (machine, torch version, rows).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from minisgl_plugin_fp8 import kernels
from minisgl_plugin_fp8.method import W8A8_TILES
from minisgl_plugin_fp8.reference import quantize_rows, quantize_token_groups, reference_linear
from minisgl_plugin_fp8.testing import quantize_weight
from minisgl_plugin_fp8.tuning import cuda_timer

# Qwen3-8B: hidden 4096, 32 q heads and 8 KV heads of 128, intermediate 12288. (name, N, K)
SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096), ("down_proj", 4096, 12288)]


GRAPH_CALLS = 20


def paths(
    x: torch.Tensor, w: torch.Tensor, n: int, k: int, sweep: bool = False, flashinfer: bool = False
) -> dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """name -> (call, the float32 reference it approximates)."""
    wq, row_scale = quantize_rows(w)
    wq, row_scale = wq.cuda(), row_scale.cuda()
    parts, _ = quantize_weight(w, "fp8-block")
    bq = parts["weight"].cuda()
    block_scale = parts["weight_scale_inv"].cuda()
    per_row = block_scale.repeat_interleave(128, 0)[:n].contiguous()
    w_bf16 = w.to(torch.bfloat16).cuda()
    ref_channel = reference_linear(x, wq, row_scale, None, None)
    ref_block = reference_linear(x, bq, per_row, 128, None)
    found = {
        "bf16": (lambda: F.linear(x, w_bf16), x.float() @ w_bf16.float().t()),
        "scaled_mm": (lambda: kernels.scaled_mm_linear(x, wq, row_scale, None), ref_channel),
        "block": (lambda: kernels.block_linear(x, bq, per_row, 128, None), ref_block),
        "dequant": (lambda: kernels.dequant_linear(x, bq, per_row, 128, None), ref_block),
    }

    # The GEMM alone, with the activations quantized beforehand: row-wise scales (what scaled_mm runs) and one
    # scale per tensor (cuBLASLt's plain FP8 GEMM), to tell the GEMM's cost from the quantization's.
    q_rows, s_rows = kernels.quant_tokens(x)
    s_tensor = torch.ones((), device="cuda")
    found["gemm_rowwise"] = (
        lambda: torch._scaled_mm(
            q_rows, wq.t(), scale_a=s_rows, scale_b=row_scale.view(1, -1), out_dtype=torch.bfloat16
        ),
        ref_channel,
    )
    found["gemm_tensor"] = (
        lambda: torch._scaled_mm(q_rows, wq.t(), scale_a=s_tensor, scale_b=s_tensor, out_dtype=torch.bfloat16),
        (q_rows.float() @ wq.float().t()),
    )
    # The same with fast accumulation (the tensor cores' own FP8 accumulator, no periodic promotion to float32).
    found["gemm_rowwise_fast"] = (
        lambda: torch._scaled_mm(
            q_rows,
            wq.t(),
            scale_a=s_rows,
            scale_b=row_scale.view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        ),
        ref_channel,
    )
    found["gemm_tensor_fast"] = (
        lambda: torch._scaled_mm(
            q_rows, wq.t(), scale_a=s_tensor, scale_b=s_tensor, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        (q_rows.float() @ wq.float().t()),
    )
    if flashinfer:  # FlashInfer's FP8 GEMMs where this build has them (JIT-built on first use)
        import flashinfer.gemm as fg

        if hasattr(fg, "bmm_fp8"):  # cuBLASLt, per-tensor scales, batched [B, M, K] x [B, K, N]
            found["fi_bmm_fp8"] = (
                lambda: fg.bmm_fp8(q_rows[None], wq.t()[None], s_tensor, s_tensor, torch.bfloat16)[0],
                (q_rows.float() @ wq.float().t()),
            )
        if hasattr(fg, "fp8_blockscale_gemm_sm90"):  # bf16 activations quantized inside, 128x128 weight blocks
            found["fi_blockscale_sm90"] = (
                lambda: fg.fp8_blockscale_gemm_sm90(x, bq, weight_scale=block_scale, out_dtype=torch.bfloat16),
                ref_block,
            )
    # The load-time tuning's other candidates (kernels.py): fast accumulation, cuBLASLt's unit-scale GEMM plus a
    # scaling kernel, the Triton W8A8 GEMM (its default tile; --sweep adds every tile the tuning tries, as
    # w8_<BM>_<BN>_<BK>_w<warps>_s<stages>) and weight-only FP8 (--sweep: its tiles as wo_<BN>_w<warps>_s<stages>).
    one = torch.ones((), device="cuda")
    found["scaled_mm_fast"] = (lambda: kernels.scaled_mm_linear(x, wq, row_scale, None, fast_accum=True), ref_channel)
    found["tensor_epi"] = (lambda: kernels.tensor_epilogue_linear(x, wq, row_scale, None, one), ref_channel)
    found["w8a8"] = (lambda: kernels.w8a8_linear(x, wq, row_scale, None), ref_channel)
    m = x.shape[0]
    if sweep:
        for tile, lo, hi in W8A8_TILES:
            if lo < m <= hi:
                name = "w8_" + "_".join(str(v) for v in tile[:3]) + f"_w{tile[3]}_s{tile[4]}"
                found[name] = (partial(kernels.w8a8_linear, x, wq, row_scale, None, tile), ref_channel)
    found["weight_only"] = (lambda: kernels.weight_only_linear(x, wq, row_scale, None, None), ref_channel)
    found["weight_only_block"] = (lambda: kernels.weight_only_linear(x, bq, per_row, 128, None), ref_block)
    if sweep and m <= 256:
        block_m = kernels.weight_only_tile(m, n)[0]
        for block_n in (32, 64, 128):
            for warps, stages in ((4, 3), (4, 5), (8, 4)):
                tile = (block_m, block_n, 128, warps, stages)
                found[f"wo_{block_n}_w{warps}_s{stages}"] = (
                    partial(kernels.weight_only_linear, x, wq, row_scale, None, None, tile),
                    ref_channel,
                )

    # torch's own block-scaled FP8 GEMM (1x128 activations x 1x128 weights): scale_a [M, KB] and scale_b
    # [KB, N], both outer-dimension-major (the transposes of contiguous [KB, M] and [N, KB] tensors).
    def torch_block() -> torch.Tensor:
        q, s = quantize_token_groups(x, 128)
        a_scale = s.t().contiguous().t()
        return torch._scaled_mm(q[:, :k], bq.t(), scale_a=a_scale, scale_b=per_row.t(), out_dtype=torch.bfloat16)

    try:
        torch_block()
        found["scaled_mm_1x128"] = (torch_block, ref_block)
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"scaled_mm_1x128 unavailable at N={n} K={k}: {str(exc).splitlines()[0][:160]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--m", default="1,16,64,256,2048,8192", help="token counts, comma-separated")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--graph", action="store_true", help="time CUDA graph replays (device time only)")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate kernels' tile configs")
    parser.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's FP8 GEMMs (fi_*)")
    parser.add_argument("--only", default="", help="time only these paths, comma-separated (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA GPU")
    torch.manual_seed(0)
    only = {p for p in args.only.split(",") if p}
    rows = []
    print(f"{'shape':14} {'M':>5} {'path':16} {'ms':>9} {'TFLOP/s':>8} {'rel err':>8}")
    for name, n, k in SHAPES:
        w = torch.randn(n, k) * k**-0.5
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for path, (call, ref) in paths(x, w, n, k, args.sweep, args.flashinfer).items():
                if only and path not in only and not any(path.startswith(p) for p in only if p.endswith("_")):
                    continue
                try:
                    for _ in range(args.warmup):
                        call()
                    calls = GRAPH_CALLS if args.graph else 1
                    ms = cuda_timer(call, m, calls=calls, repeats=args.iters, graph_timing=args.graph)
                    err = float((call().float() - ref).norm() / ref.norm())
                except Exception as exc:  # one path that fails (a Triton build, a cuBLASLt shape) costs its row only
                    print(f"{name:14} {m:5d} {path:16} failed: {str(exc).splitlines()[0][:160]}")
                    rows.append({"shape": name, "m": m, "n": n, "k": k, "path": path, "error": str(exc)[:500]})
                    continue
                tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
                rows.append({"shape": name, "m": m, "n": n, "k": k, "path": path, "ms": ms, "tflops": tflops})
                rows[-1]["rel_err"] = err
                print(f"{name:14} {m:5d} {path:16} {ms:9.4f} {tflops:8.1f} {err:8.4f}")
    result = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "timing": "cuda-graph" if args.graph else "eager",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
