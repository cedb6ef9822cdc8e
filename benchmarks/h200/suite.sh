#!/usr/bin/env bash
# H200 session, call 1 of 3: the whole GPU suite (every CUDA test of every package), TensorRT-LLM's
# XQA decode timing, and the first part of FlashAttention 4's compiler kept in /tmp for fa.sh.
# Run from the repository root with .whl (../shared/gpu/wheels.sh httptools) and
# plugins/minisgl-plugin-fa/build/gpu-a (plugins/minisgl-plugin-fa/gpu/pack_wheels.sh) carried;
# MINISGL_COMMIT names the commit under test; SUITE_ONLY=1 runs the suite alone, JOBS=N files at
# once. Results in $OUT: gpu-suite/gpu-suite.{md,json},
# suite-logs.tgz, plugins.txt, trtllm_decode.json, log.txt.
set -uo pipefail
export LIMIT=${LIMIT:-510} MAX_JOBS=16
source benchmarks/h200/setup.sh
[ -d plugins/minisgl-plugin-fa/build/gpu-a ] && mkdir -p /tmp/fa-stage && cp plugins/minisgl-plugin-fa/build/gpu-a/cu13.part0 /tmp/fa-stage/
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
python3 -m minisgl plugins --device cuda > "$OUT/plugins.txt" 2>&1
# XQA modules build in parallel ninjas meanwhile (the suite's trtllm tests then find them built).
timeout 240 python3 plugins/minisgl-plugin-trtllm/gpu/prebuild.py > "$OUT/prebuild-xqa.log" 2>&1 &
MARGIN=70; [ -n "${SUITE_ONLY:-}" ] && MARGIN=20  # time kept for the report (and the timing)
LEFT=$((LIMIT - SECONDS - MARGIN))
python3 tests/gpu_suite.py --require-cuda --out "$OUT/gpu-suite" --jobs ${JOBS:-2} --total-timeout $LEFT \
  --file-timeout $((LEFT < 400 ? LEFT : 400)) --commit "${MINISGL_COMMIT:-unknown}" 2>&1 | tee -a "$OUT/log.txt" | tail -n 30
mv "$OUT/prebuild-xqa.log" "$OUT/gpu-suite/logs/" 2>/dev/null
tar czf "$OUT/suite-logs.tgz" -C "$OUT/gpu-suite" logs && rm -rf "$OUT/gpu-suite/logs"
[ -n "${SUITE_ONLY:-}" ] || step 60 python3 plugins/minisgl-plugin-trtllm/gpu/bench_decode.py --out "$OUT/trtllm_decode.json"
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
