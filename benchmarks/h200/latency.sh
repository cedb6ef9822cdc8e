#!/usr/bin/env bash
# One call on a lent H200: minisgl serve against Mini-SGLang's server under the protocol's online workload
# (256 streamed chat requests, Qwen3-0.6B shapes, dummy weights), each rate REPEAT times (fresh prompts and
# arrival seeds) so that every figure is a median with its spread; minisgl's step trace (--trace) and both
# servers' logs kept beside the JSON. RATES (default "inf 32 8"; MINISGL_RATES and PEER_RATES for one server),
# REPEAT (default 3), ORDER (default "minisgl peer"), MODEL_CONFIG (a config.json for both; default the 0.6B one),
# TAG (file-name suffix) and MINISGL_STEP / PEER_STEP (each server's seconds, default 300 / 330) vary it. A step
# cut by its limit still leaves the JSON of the runs it finished (marked "interrupted").
# Carry .whl and .peer; MINISGL_COMMIT names the commit. Ends every server a previous call left first.
# What comes back (at most 8 files): each server's JSON, minisgl's trace (gzipped by bench serve) with its `bench steps`
# report, and logs.tgz (the server logs and log.txt).
set -uo pipefail
export LIMIT=${LIMIT:-580}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
use_peer
MODEL=.peer/model
if [ -n "${MODEL_CONFIG:-}" ]; then MODEL=/tmp/peer-model-$$; mkdir -p $MODEL; cp .peer/model/* $MODEL/; cp "$MODEL_CONFIG" $MODEL/config.json; fi
RATES=${RATES:-inf 32 8}
BENCH="python3 -m minisgl bench serve --tokenizer $MODEL --repeat ${REPEAT:-3} --warmup 16 --no-progress --keep-server-log --output $OUT"
T=${TAG:+-$TAG}
for system in ${ORDER:-minisgl peer}; do
  if [ $system = peer ]; then
    step ${PEER_STEP:-330} $BENCH --rate ${PEER_RATES:-$RATES} --label online-peer$T --fallback-count max-tokens --base-url http://127.0.0.1:1919 --launch-timeout 240 --launch \
      "$PEER_ENV python3 -m minisgl --model-path $MODEL --dummy-weight --port 1919 --attention-backend fi --page-size 1 --cuda-graph-max-bs 256 --max-seq-len-override 4096"
  else
    step ${MINISGL_STEP:-300} $BENCH --rate ${MINISGL_RATES:-$RATES} --label online-minisgl$T --trace --base-url http://127.0.0.1:30000 --launch-timeout 180 --launch \
      "python3 -m minisgl serve --model $MODEL --load-format dummy --max-model-len 4096 --port 30000 --log-level warning ${MINISGL_ARGS:-}"
  fi
done
finish
