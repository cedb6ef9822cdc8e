#!/usr/bin/env bash
# One call on a lent GPU: the triton sampler with the hardware's approximate logarithm (what runs) against the
# exact one. First its kernel alone (gpu_probe.py sampling: both, greedy rows and the PyTorch path, batch 1..256,
# the Qwen3 and Llama-3 vocabularies) and a mixed step's attention over bf16 and FP8 caches (gpu_probe.py
# prefill: where FP8 KV's slower mixed steps come from), then the protocol's offline workload at SHAPE (default qwen3-8b) with
# VARIANT (default fp8kv) in ROUNDS (default 2) alternating rounds, the exact side patched into the plugin's
# sampler for its runs only. Carry .whl. MINISGL_COMMIT names the commit. Results in $OUT:
# gpu-probe-sampling.json, gpu-probe-prefill.json, offline-*-sampler-fast-N.json, offline-*-sampler-exact-N.json.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
SHAPE=${SHAPE:-qwen3-8b}
VARIANT=${VARIANT:-fp8kv}
C8=benchmarks/minisgl-bench/src/minisgl_bench/configs/$SHAPE.json
args=$(variant_args $VARIANT)
prebuild_variants $VARIANT
step 120 python3 benchmarks/h200/gpu_probe.py sampling "$OUT"
step 90 python3 benchmarks/h200/gpu_probe.py prefill "$OUT"
SAMPLER=plugins/minisgl-plugin-triton/src/minisgl_plugin_triton/sampling.py
cp $SAMPLER /tmp/sampling.fast.py
sed -e 's/FAST=not isinstance(_gumbel_chunk_kernel, InterpretedFunction) if fast_log is None else fast_log,/FAST=False,/' $SAMPLER > /tmp/sampling.exact.py
grep -q "FAST=False," /tmp/sampling.exact.py || { echo "exact patch failed"; exit 1; }
for round in $(seq ${ROUNDS:-2}); do
  for side in fast exact; do
    cp /tmp/sampling.$side.py $SAMPLER
    step 100 env $(variant_env $VARIANT) python3 -m minisgl bench offline --model-config $C8 --output $OUT $args --label offline-$SHAPE-$VARIANT-sampler-$side-$round
  done
done
cp /tmp/sampling.fast.py $SAMPLER
finish
