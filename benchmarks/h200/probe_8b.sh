#!/usr/bin/env bash
# One call on a lent H200 (issue: FP8 and 8B speed): which decode kernel an FP8 KV cache should use.
# The paged decode kernels alone at the 8B shapes (32 query / 8 KV heads, head_dim 128) with bf16 and FP8 KV:
# FlashInfer with tensor cores on and off, and TensorRT-LLM's XQA (gpu_probe.py attention); then the offline
# workload at the Qwen3-8B shape with FP8 weights + FP8 KV decoded by FlashInfer (the default) and by XQA
# (--attn flashinfer,trtllm-xqa), and FP8 weights + bf16 KV beside them. XQA's modules are compiled first, in
# parallel (plugins/minisgl-plugin-trtllm/gpu/prebuild.py). Carry .whl; MINISGL_COMMIT names the commit.
# Results in $OUT: gpu-probe-attention-h32-*.json, offline-*.json, logs.tgz.
set -uo pipefail
export LIMIT=${LIMIT:-590}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
C8=benchmarks/minisgl-bench/src/minisgl_bench/configs/qwen3-8b.json
B="python3 -m minisgl bench offline --model-config $C8 --output $OUT --quantization fp8"
step 200 python3 plugins/minisgl-plugin-trtllm/gpu/prebuild.py
step 150 env PROBE_HEADS=32 PROBE_KV=bf16,fp8_e4m3 python3 benchmarks/h200/gpu_probe.py attention "$OUT"
step 110 $B --kv-cache-dtype fp8_e4m3 --attn flashinfer,trtllm-xqa --label offline-qwen3-8b-fp8-kvfp8-xqa
step 110 $B --kv-cache-dtype fp8_e4m3 --label offline-qwen3-8b-fp8-kvfp8-flashinfer
step 90 $B --label offline-qwen3-8b-fp8
finish
