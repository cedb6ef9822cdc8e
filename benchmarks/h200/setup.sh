#!/usr/bin/env bash
# Sourced by the scripts in benchmarks/h200/ (and tests/gpu_suite.sh) on a lent H200 host: makes $OUT
# (default /tmp/out), installs the carried wheels into /tmp/site, puts the project's sources on PYTHONPATH
# (the core, every plugin under plugins/, found by its folder, and the benchmarks, benchmarks/minisgl-bench)
# and writes the dist-info metadata that makes the plugins' entry points visible (they are not pip-installed
# there).
# Ends, by PID, every server, replica and router an earlier call left on this host (each holds GPU memory and
# would make this call fail or lie). Defines `step LIMIT CMD...`, `variant_args`, `prebuild_variants`, `use_peer` (Mini-SGLang's wheels, PEER_ENV)
# and `finish` (reports and packing at the end).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}  # the call's results (what the device tool brings back), and log.txt
mkdir -p "$OUT"
for pid in $(pgrep -f "minisgl (serve|--model-path)|sglang_router" || true); do
  [ "$pid" != $$ ] && kill -9 "$pid" 2>/dev/null
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
# The core, every plugins/minisgl-plugin-*/src and minisgl-bench, each with the dist-info that importlib.metadata reads:
# name, version, its requirement on minisgl and its [project.entry-points.minisgl] (from its pyproject.toml).
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/benchmarks/minisgl-bench/src:$PWD/tests
for src in plugins/minisgl-plugin-*/src; do PYTHONPATH=$PYTHONPATH:$PWD/$src; done
python3 benchmarks/dist_info.py . /tmp/site || exit 1
LIMIT=${LIMIT:-560}
# Each step gets at most its own limit and never runs past the call's overall LIMIT (seconds).
step() { local t=$1; shift; local left=$((LIMIT - SECONDS)); [ $left -lt 30 ] && { echo "=== skipped: $*" | tee -a $OUT/log.txt; return; }
  [ $t -gt $left ] && t=$left; echo "=== $* (${t}s)" | tee -a $OUT/log.txt
  timeout "$t" "$@" 2>&1 | tee -a $OUT/log.txt | grep -v Warning | tail -n 14; }
# The engine flags of each FP8 variant the 8B scripts (fp8.sh, online_8b.sh) run: `variant_args NAME` prints them
# (fails on an unknown name). fp8kv leaves --attn to auto, which decodes an FP8 cache with XQA where the trtllm
# plugin runs (Hopper, Blackwell); fp8kv-flashinfer decodes it with FlashInfer, fp8kv-xqa names the pair.
# `prebuild_variants NAMES...` compiles XQA's FP8 modules first when a variant decodes with it. fp8-unfused and
# fp8kv-unfused are fp8 and fp8kv with the activations quantized inside the GEMMs (`variant_env` prints
# MINISGL_FP8_FUSE=0 for them: run `env $(variant_env NAME) CMD`), the A/B of the fused RMSNorm and SiLU x up;
# fp8kv-ragged and bf16-ragged are fp8kv and bf16 with FlashInfer's ragged prefill of fresh prompts on
# (MINISGL_FLASHINFER_RAGGED=1; off by default), fp8kv-paged and bf16-paged with it off by name: its A/B.
# A variant may end in -tput (--schedule-policy throughput: longest max_tokens first, prompts paced into the decode
# steps) or -fcfs (the default policy, by name) and, before that, in -stepN (--throughput-step-tokens N):
# bf16-step384-tput. A final -split runs it with FlashInfer's decode kernel for a mixed step's decoding rows
# (MINISGL_FLASHINFER_SPLIT_DECODE=1): bf16-tput-split.
variant_args() {
  local v=${1%-split} extra=""
  case $v in *-fcfs) extra="--schedule-policy fcfs"; v=${v%-fcfs} ;; *-tput) extra="--schedule-policy throughput"; v=${v%-tput} ;; esac
  case $v in *-step[0-9]*) extra="--throughput-step-tokens ${v##*-step} $extra"; v=${v%-step*} ;; esac
  case $v in
    bf16|bf16-paged|bf16-ragged) echo "$extra" ;;
    fp8|fp8-unfused) echo "--quantization fp8 $extra" ;;
    fp8kv|fp8kv-unfused|fp8kv-paged|fp8kv-ragged) echo "--quantization fp8 --kv-cache-dtype fp8_e4m3 $extra" ;;
    fp8kv-flashinfer) echo "--quantization fp8 --kv-cache-dtype fp8_e4m3 --attn flashinfer $extra" ;;
    fp8kv-xqa) echo "--quantization fp8 --kv-cache-dtype fp8_e4m3 --attn flashinfer,trtllm-xqa $extra" ;;
    *) echo "unknown variant $1 (bf16, bf16-paged, bf16-ragged, fp8, fp8-unfused, fp8kv, fp8kv-unfused, fp8kv-paged, fp8kv-ragged, fp8kv-flashinfer, fp8kv-xqa; each may end in -stepN and then -tput or -fcfs)" \
      | tee -a "$OUT/log.txt" >&2; return 1 ;;
  esac
}
variant_env() {
  local v=${1%-split}
  [ "$v" != "$1" ] && echo "MINISGL_FLASHINFER_SPLIT_DECODE=1"
  v=${v%-tput}; v=${v%-fcfs}; v=${v%-step[0-9]*}
  case $v in
    *-unfused) echo "MINISGL_FP8_FUSE=0" ;;
    *-paged) echo "MINISGL_FLASHINFER_RAGGED=0" ;;
    *-ragged) echo "MINISGL_FLASHINFER_RAGGED=1" ;;
  esac
}
prebuild_variants() {
  case " $* " in *" fp8kv "*|*" fp8kv-"*) step 200 python3 plugins/minisgl-plugin-trtllm/gpu/prebuild.py fp8 ;; esac
}
# Mini-SGLang (carried in .peer by ../shared/bench/peer/setup.sh) with its wheels in /tmp/psite; PEER_ENV runs it.
# Never on one path with this project: both are 'minisgl'.
use_peer() {
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/psite \
    $(ls .whl/*.whl | grep -v typing_extensions) .peer/whl/*.whl 2>&1 | tail -n 2
  PEER_ENV="env PYTHONPATH=/tmp/psite:$PWD/.peer/python"
}
# The end of a benchmark call: `minisgl bench steps` beside each gzipped step trace (split by the runs of its
# record), the call's time in log.txt, then the server logs, log.txt and the files matching the patterns given
# (`finish '*.steps.txt'`) packed into logs.tgz (the device tool brings back at most 8 files).
finish() {
  for t in "$OUT"/*.trace.jsonl.gz; do
    [ -f "$t" ] && python3 -m minisgl bench steps "$t" --record "${t%.trace.jsonl.gz}.json" > "${t%.trace.jsonl.gz}.steps.txt" 2>&1
  done
  echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.server.log $* 2>/dev/null) log.txt)
}
