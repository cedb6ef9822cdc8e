#!/usr/bin/env bash
# One device call: where a mixed step's time goes (mixed_probe.py, Qwen3-8B shape, dummy weights) with FlashInfer
# computing the decoding rows of a mixed batch in its prefill kernel (MINISGL_FLASHINFER_SPLIT_DECODE=0) and in
# its decode kernel (=1), and with the K/V stores inside the prefill graphs' pieces or between them, then the
# flashinfer plugin's and the prefill graphs' GPU tests. Run from the repository root with .whl carried; CHUNK
# (default 160) is the prompt chunk beside the decodes. Results in $OUT: mixed-probe-split{0-in,1-in,0-out}.json,
# log.txt.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
CONFIG=benchmarks/minisgl-bench/src/minisgl_bench/configs/${SHAPE:-qwen3-8b}.json
# RUNS: split-decode flag and where the K/V stores run (in: inside the prefill graphs' pieces, out: eagerly).
for run in ${RUNS:-0-in 1-in 0-out}; do
  step ${PROBE_STEP:-150} env MINISGL_FLASHINFER_SPLIT_DECODE=${run%-*} PROBE_STORE_OUTSIDE=$([ ${run#*-} = out ] && echo 1 || echo 0) \
    python3 benchmarks/h200/mixed_probe.py "$CONFIG" "$OUT/mixed-probe-split$run.json" ${CHUNK:-160}
done
step 200 python3 -m pytest -q plugins/minisgl-plugin-flashinfer/tests core/tests/test_prefill_graphs_gpu.py -p no:cacheprovider
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
