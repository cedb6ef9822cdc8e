#!/usr/bin/env bash
# One call on a lent H200: what a long prompt does to the streams already decoding, with prefill chunks mixed
# into decode steps (--mixed-prefill, the default) and without (a step is a prefill while prompt tokens wait).
# 1. benchmarks/long_prompt_gap.py in-process: STREAMS streams (default 64) decode, then one prompt of PROMPT_LEN
#    tokens (default 8000) arrives, in chunks of CHUNK tokens (default 8192: one chunk; 2048 makes four, where the
#    policies differ); the streams' median and longest gap, the long prompt's TTFT. Qwen3-0.6B shapes, then
#    MODEL_CONFIG's (default Qwen3-8B's), dummy weights. GAP_ONLY=1 skips part 2.
# 2. `minisgl serve` under the long-prompt workload (NUM_REQUESTS streamed chats, default 128, of 2,048-3,072
#    prompt tokens and 16-64 output tokens) at RATES (default "8 16"), REPEAT times (default 2), mixed on and off,
#    with the step trace.
# Carry .whl and .peer/model (../shared/bench/peer/setup.sh). Results in $OUT: JSON, traces, steps reports, logs.tgz.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
BIG=/tmp/long-prompt-model-$$
mkdir -p $BIG && cp .peer/model/* $BIG/ && cp "${MODEL_CONFIG:-benchmarks/minisgl-bench/src/minisgl_bench/configs/qwen3-8b.json}" $BIG/config.json
GAP="python3 benchmarks/long_prompt_gap.py --device cuda --load-format dummy --streams ${STREAMS:-64}"
GAP="$GAP --prompt-len ${PROMPT_LEN:-8000} --chunk ${CHUNK:-8192} --max-model-len 16384"
C=-chunk${CHUNK:-8192}
step 120 $GAP --model .peer/model --output "$OUT/long-prompt-gap-0.6b$C.json"
# On a freshly started machine the 8B engines compile their FlashInfer kernels first: give them the time.
step 240 $GAP --model $BIG --output "$OUT/long-prompt-gap-8b$C.json"
[ "${GAP_ONLY:-0}" = 1 ] && { finish; exit 0; }
BENCH="python3 -m minisgl bench serve --workload long-prompt --tokenizer .peer/model --rate ${RATES:-8 16}"
BENCH="$BENCH --num-requests ${NUM_REQUESTS:-128}"
BENCH="$BENCH --repeat ${REPEAT:-2} --warmup 16 --no-progress --keep-server-log --output $OUT --trace"
for variant in mixed prefill-first; do
  args=""; [ $variant = prefill-first ] && args="--no-mixed-prefill"
  step 130 $BENCH --label long-prompt-$variant --base-url http://127.0.0.1:30000 --launch-timeout 150 --launch \
    "python3 -m minisgl serve --model .peer/model --load-format dummy --max-model-len 4096 --port 30000 --log-level warning $args"
done
finish '*.steps.txt'
