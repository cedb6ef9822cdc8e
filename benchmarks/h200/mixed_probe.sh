#!/usr/bin/env bash
# One device call: where a mixed step's time goes (mixed_probe.py, Qwen3-8B shape, dummy weights) with FlashInfer
# computing the decoding rows of a mixed batch in its prefill kernel (MINISGL_FLASHINFER_SPLIT_DECODE=0) and in
# its decode kernel (=1), then the flashinfer plugin's GPU tests. Run from the repository root with .whl carried;
# CHUNK (default 160) is the prompt chunk beside the decodes. Results in $OUT: mixed-probe-split{0,1}.json, log.txt.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
CONFIG=benchmarks/minisgl-bench/src/minisgl_bench/configs/${SHAPE:-qwen3-8b}.json
for split in ${SPLITS:-0 1}; do
  step ${PROBE_STEP:-200} env MINISGL_FLASHINFER_SPLIT_DECODE=$split python3 benchmarks/h200/mixed_probe.py "$CONFIG" \
    "$OUT/mixed-probe-split$split.json" ${CHUNK:-160}
done
step 150 python3 -m pytest -q -x plugins/minisgl-plugin-flashinfer/tests -p no:cacheprovider
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
