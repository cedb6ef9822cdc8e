#!/usr/bin/env bash
# One call on a lent H200: where the 8B offline run's time goes (issue: FP8 and 8B speed). First the FP8 and
# bf16 GEMMs at Qwen3-8B's linear shapes timed inside CUDA graphs (device time, as the decode graphs run them;
# plugins/minisgl-plugin-fp8/gpu/bench_gemm.py --graph --sweep --flashinfer: every path and candidate tile), then
# the protocol's offline workload with Qwen3-8B shapes (dummy weights) in bf16, with FP8 weights, and with FP8
# weights + FP8 KV, each with a profile of 256 short requests (the kernels and ops by device time: `minisgl bench
# offline --profile`). Carry .whl. MINISGL_COMMIT names the commit. Results in $OUT: gemm-graph.json,
# offline-*.json, profile-*.txt, logs.tgz.
set -uo pipefail
export LIMIT=${LIMIT:-590}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
C8=benchmarks/minisgl-bench/src/minisgl_bench/configs/qwen3-8b.json
step ${GEMM_S:-190} python3 plugins/minisgl-plugin-fp8/gpu/bench_gemm.py --graph --sweep --flashinfer \
  --m ${GEMM_M:-16,64,128,256,512,2048,8192} --iters 30 --out "$OUT/gemm-graph.json"
B="python3 -m minisgl bench offline --model-config $C8 --output $OUT"
step 140 $B --label offline-qwen3-8b-bf16 --profile "$OUT/profile-qwen3-8b-bf16.txt"
step 110 $B --quantization fp8 --label offline-qwen3-8b-fp8 --profile "$OUT/profile-qwen3-8b-fp8.txt"
step 110 $B --quantization fp8 --kv-cache-dtype fp8_e4m3 --label offline-qwen3-8b-fp8-kvfp8 \
  --profile "$OUT/profile-qwen3-8b-fp8-kvfp8.txt"
finish
