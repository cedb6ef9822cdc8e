#!/usr/bin/env bash
# The second call after profile_8b.sh (issue: FP8 and 8B speed), on the same warm H200: FlashInfer's paged decode
# kernel alone at the 8B shapes (32 query / 8 KV heads, head_dim 128) with bf16 and FP8 KV, tensor cores on and off
# (gpu_probe.py attention), FlashInfer's FP8 GEMMs beside torch's (bench_gemm.py --flashinfer), and the offline
# workload with FP8 weights + FP8 KV with its profile. Carry .whl; MINISGL_COMMIT names the commit. Results in $OUT:
# gpu-probe-attention-h32-*.json, gemm-flashinfer.json, offline-*.json, profile-*.txt, logs.tgz.
set -uo pipefail
export LIMIT=${LIMIT:-590}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
C8=benchmarks/minisgl-bench/src/minisgl_bench/configs/qwen3-8b.json
step 200 env PROBE_HEADS=32 PROBE_KV=bf16,fp8_e4m3 python3 benchmarks/h200/gpu_probe.py attention "$OUT"
step 150 python3 plugins/minisgl-plugin-fp8/gpu/bench_gemm.py --graph --flashinfer --only bf16,scaled_mm,gemm_rowwise,fi_ \
  --m 16,64,256,2048 --iters 30 --out "$OUT/gemm-flashinfer.json"
step 150 python3 -m minisgl bench offline --model-config $C8 --output $OUT --quantization fp8 --kv-cache-dtype fp8_e4m3 \
  --label offline-qwen3-8b-fp8-kvfp8 --profile "$OUT/profile-qwen3-8b-fp8-kvfp8.txt"
finish
