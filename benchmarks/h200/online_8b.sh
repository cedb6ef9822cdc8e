#!/usr/bin/env bash
# One call on a lent H200: the protocol's online workload (256 streamed chat requests, 16 to warm up) at an 8B shape
# with dummy weights, `minisgl serve` in bf16, with FP8 weights and with FP8 weights + FP8 KV, then Mini-SGLang's
# server in bf16 (issue: FP8 and 8B speed). SHAPE (default qwen3-8b; llama-3.1-8b), RATES (default "inf 16 8"),
# REPEAT (default 1), VARIANTS (default "bf16 fp8 fp8kv"; fp8kv decodes with XQA under --attn auto,
# fp8kv-flashinfer with FlashInfer, fp8kv-xqa names the pair) and PEER=0 (leave the peer out) vary it;
# each minisgl variant gets MINISGL_STEP seconds (default 150), the peer PEER_STEP (default 300: its first start
# builds FlashInfer's kernels). Carry .whl and .peer; MINISGL_COMMIT names the commit. Ends every server a previous
# call left first. All of it does not fit one call: run VARIANTS="bf16 fp8 fp8kv" PEER=0, then VARIANTS=bf16 (the
# peer beside bf16 in one call). What comes back: one JSON per server (online-<shape>-<variant>.json, online-<shape>-peer.json;
# a step cut by its limit keeps the runs it finished, marked "interrupted") and logs.tgz (server logs, log.txt).
set -uo pipefail
export LIMIT=${LIMIT:-590}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
use_peer
SHAPE=${SHAPE:-qwen3-8b}
MODEL=/tmp/peer-$SHAPE  # the peer reads a model folder: this shape's config and the demo tokenizer; minisgl reads the same
mkdir -p $MODEL && cp .peer/model/* $MODEL/ && cp benchmarks/minisgl-bench/src/minisgl_bench/configs/$SHAPE.json $MODEL/config.json
VARIANTS=${VARIANTS:-bf16 fp8 fp8kv}
prebuild_variants $VARIANTS
BENCH="python3 -m minisgl bench serve --tokenizer $MODEL --rate ${RATES:-inf 16 8} --repeat ${REPEAT:-1} --warmup 16 --no-progress --keep-server-log --output $OUT"
for variant in $VARIANTS; do
  args=$(variant_args $variant) || continue
  step ${MINISGL_STEP:-150} env $(variant_env $variant) $BENCH --label online-$SHAPE-$variant --base-url http://127.0.0.1:30000 --launch-timeout 120 --launch \
    "python3 -m minisgl serve --model $MODEL --load-format dummy --max-model-len 4096 --port 30000 --log-level warning $args"
done
if [ "${PEER:-1}" != 0 ]; then
  step ${PEER_STEP:-300} $BENCH --label online-$SHAPE-peer --fallback-count max-tokens --base-url http://127.0.0.1:1919 --launch-timeout 240 --launch \
    "$PEER_ENV python3 -m minisgl --model-path $MODEL --dummy-weight --port 1919 --attention-backend fi --page-size 1 --cuda-graph-max-bs 256 --max-seq-len-override 4096"
fi
finish
