#!/usr/bin/env bash
# One call on a lent H200: the protocol's offline workload at the sizes users serve (Qwen3-8B and Llama-3.1-8B
# shapes, dummy weights) in bf16, FP8 weights (--quantization fp8) and FP8 weights + FP8 KV (--kv-cache-dtype
# fp8_e4m3, which --attn auto decodes with XQA where the trtllm plugin runs), against Mini-SGLang bf16 on the same
# shapes, then Qwen3-0.6B bf16 for both. SHAPES (default "qwen3-8b llama-3.1-8b") and VARIANTS (default "bf16 fp8
# fp8kv"; also fp8kv-flashinfer, FlashInfer decoding the FP8 cache, and fp8kv-xqa, the pair named) pick what runs;
# SMALL=0 leaves the 0.6B pair out, SMALL_VARIANTS (default bf16) names the 0.6B runs. Carry .whl and .peer (../shared/bench/peer/setup.sh). MINISGL_COMMIT names the
# commit. Results in $OUT (the peer prints one JSON line per run, kept in log.txt). Each step is given its limit;
# the call's LIMIT skips what no longer fits; RUN_STEP (default 90 s) is each engine run's (give the first run on a fresh
# machine more: FlashInfer compiles its prefill kernels then); PEER_FIRST_STEP (default 300 s) is the peer's first
# run's and PEER_STEP (default 240 s) its later ones'. PEER=0 leaves Mini-SGLang out (an A/B of our variants).
set -uo pipefail
export LIMIT=${LIMIT:-570}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
[ "${PEER:-1}" != 0 ] && use_peer
CONFIGS=benchmarks/minisgl-bench/src/minisgl_bench/configs
B="python3 -m minisgl bench offline --output $OUT"
VARIANTS=${VARIANTS:-bf16 fp8 fp8kv}
prebuild_variants $VARIANTS
# The peer's first run compiles FlashInfer's kernels (its graph capture at batch 256 took 127 s on a fresh
# machine, 2026-12-04, and its prefill compiles after that): 200 s was not enough for Qwen3-8B. Later runs on a
# warm H100 still spend 80-100 s capturing graphs (2026-12-07: 102 s for Qwen3-8B, 95 s for Qwen3-0.6B), and
# neither a 200 s Qwen3-8B step nor a 120 s 0.6B step was enough then: PEER_STEP (default 240) is theirs.
peer_step=${PEER_FIRST_STEP:-300}
for shape in ${SHAPES:-qwen3-8b llama-3.1-8b}; do
  mkdir -p /tmp/peer-$shape && cp .peer/model/* /tmp/peer-$shape/ && cp $CONFIGS/$shape.json /tmp/peer-$shape/config.json
  for variant in $VARIANTS; do
    args=$(variant_args $variant) || continue
    step ${RUN_STEP:-90} env $(variant_env $variant) $B --model-config $CONFIGS/$shape.json $args --label offline-$shape-$variant \
      --trace-steps /tmp/trace-$shape-$variant.jsonl
  done
  [ "${PEER:-1}" != 0 ] && { step $peer_step $PEER_ENV python3 .peer/offline_peer.py 1 /tmp/peer-$shape; peer_step=${PEER_STEP:-240}; }
done
if [ "${SMALL:-1}" != 0 ]; then
  for variant in ${SMALL_VARIANTS:-bf16}; do
    args=$(variant_args $variant) || continue
    step 60 $B $args --label offline-qwen3-0.6b-$variant --trace-steps /tmp/trace-qwen3-0.6b-$variant.jsonl
  done
  [ "${PEER:-1}" != 0 ] && step $peer_step $PEER_ENV python3 .peer/offline_peer.py 1
fi
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
