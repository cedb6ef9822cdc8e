#!/usr/bin/env bash
# One call on a lent H200: prefill CUDA graphs (--cuda-graph-max-tokens) checked and timed. First their GPU
# tests (core/tests/test_prefill_graphs_gpu.py: replay against eager), then `minisgl serve` under the
# protocol's online workload (256 streamed chats, Qwen3-0.6B shapes, dummy weights) with the graphs (default)
# and without them (--cuda-graph-max-tokens 0), each rate REPEAT times, both with the step trace. RATES
# (default "32 8"), REPEAT (default 2), ORDER (default "graphs eager") vary it. Carry .whl and .peer/model
# (the model directory ../shared/bench/peer/setup.sh makes). Results: JSON, traces and logs in $OUT.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
step ${TEST_LIMIT:-170} python3 -m pytest -q -m cuda -p no:cacheprovider core/tests/test_prefill_graphs_gpu.py
MODEL=.peer/model
BENCH="python3 -m minisgl bench serve --tokenizer $MODEL --rate ${RATES:-32 8} --repeat ${REPEAT:-2} --warmup 16 --no-progress --keep-server-log --output $OUT --trace"
for variant in ${ORDER:-graphs eager}; do
  args=""; [ $variant = eager ] && args="--cuda-graph-max-tokens 0"
  step 200 $BENCH --label online-prefill-$variant --base-url http://127.0.0.1:30000 --launch-timeout 180 --launch \
    "python3 -m minisgl serve --model $MODEL --load-format dummy --max-model-len 4096 --port 30000 --log-level info $args"
done
finish
