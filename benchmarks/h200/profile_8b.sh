#!/usr/bin/env bash
# One call on a lent H200: where the 8B offline run's time goes (issue: FP8 and 8B speed). Optionally (GEMM=1) the
# FP8 and bf16 GEMMs at Qwen3-8B's linear shapes timed inside CUDA graphs (plugins/minisgl-plugin-fp8/gpu/
# bench_gemm.py --graph --sweep --flashinfer: every path and candidate tile); then, for each of VARIANTS (default
# "fp8kv bf16"; the names of setup.sh's variant_args) at SHAPE (default qwen3-8b), the protocol's offline workload
# with dummy weights and a step trace (the record's "steps": device and host time by step kind, decode's device
# time by batch, the share of the wall clock the device was busy), then a profile of 256 requests of
# PROFILE_PROMPT (default 512) tokens decoding PROFILE_STEPS (default 64) tokens after their prompts were prefilled
# once (the kernels and ops by device time: `minisgl bench offline --profile`). Carry .whl. MINISGL_COMMIT names
# the commit. Results in $OUT: gemm-graph.json, offline-*.json, profile-*.txt, logs.tgz (log.txt, the traces).
set -uo pipefail
export LIMIT=${LIMIT:-590}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
SHAPE=${SHAPE:-qwen3-8b}
C8=benchmarks/minisgl-bench/src/minisgl_bench/configs/$SHAPE.json
if [ "${GEMM:-0}" != 0 ]; then
  step ${GEMM_S:-190} python3 plugins/minisgl-plugin-fp8/gpu/bench_gemm.py --graph --sweep --flashinfer \
    --m ${GEMM_M:-16,64,128,256,512,2048,8192} --iters 30 --out "$OUT/gemm-graph.json"
fi
VARIANTS=${VARIANTS:-fp8kv bf16}
prebuild_variants $VARIANTS
for variant in $VARIANTS; do
  args=$(variant_args $variant) || continue
  step ${RUN_S:-120} env $(variant_env $variant) python3 -m minisgl bench offline --model-config $C8 --output $OUT $args --label offline-$SHAPE-$variant \
    --trace-steps "$OUT/$SHAPE-$variant.trace.jsonl" --profile "$OUT/profile-$SHAPE-$variant.txt" \
    --profile-prompt-len ${PROFILE_PROMPT:-512} --profile-steps ${PROFILE_STEPS:-64}
done
gzip -f "$OUT"/*.trace.jsonl 2>/dev/null
(cd "$OUT" && tar czf traces.tgz --remove-files *.trace.jsonl.gz 2>/dev/null)
finish
