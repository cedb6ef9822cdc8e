#!/usr/bin/env bash
# H200 session, call 2 (on the machine still warm from suite.sh, which staged .whl and the first part of
# FlashAttention 4's compiler): the fa plugin's GPU tests with FlashAttention 4, then the protocol's
# offline workload at this commit and at a baseline tree, alternating, in the same call.
# Carry plugins/minisgl-plugin-fa/build/gpu-b, .base (the baseline: `git archive BASE core plugins`
# unpacked there) and .bench-model (config.json and tokenizer files for the grammar-mask timing).
# MINISGL_COMMIT and BASE_COMMIT name the two trees. Results in $OUT.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
b=plugins/minisgl-plugin-fa/build/gpu-b fa_site=/tmp/site-fa
if [ -f /tmp/fa-stage/cu13.part0 ] && [ -d $b ]; then
  cat /tmp/fa-stage/cu13.part0 $b/cu13.part[1-9] > /tmp/fa-stage/dsl.tar.xz
  rm -rf $fa_site && mkdir -p $fa_site
  for w in $b/*.whl; do python3 -m zipfile -e "$w" $fa_site; done
  python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" /tmp/fa-stage/dsl.tar.xz $fa_site
  python3 -c "import cuda.bindings.driver" 2>/dev/null || for w in $b/fallback/*.whl; do python3 -m zipfile -e "$w" $fa_site; done
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa-cute-cache
  FA_PATH=$fa_site:$fa_site/nvidia_cutlass_dsl/dsl_packages
  PYTHONPATH=$FA_PATH:$PYTHONPATH step 240 python3 tests/gpu_suite.py --require-cuda --out "$OUT/fa-suite" \
    --total-timeout 230 --file-timeout 230 --commit "${MINISGL_COMMIT:-unknown}" plugins/minisgl-plugin-fa/tests/test_fa_gpu.py
  tar czf "$OUT/fa-logs.tgz" -C "$OUT/fa-suite" logs 2>/dev/null && rm -rf "$OUT/fa-suite/logs"
fi
# The baseline tree, with dist-info of its own (its versions and requirements) ahead of this tree's.
NEW_PATH=$PYTHONPATH
BASE_PATH=/tmp/site-base:/tmp/site:$PWD/.base/core/src
for src in .base/plugins/minisgl-plugin-*/src; do BASE_PATH=$BASE_PATH:$PWD/$src; done
python3 benchmarks/dist_info.py .base /tmp/site-base
# This tree's plugins the baseline does not ship (their entry names), kept out of the baseline's runs.
NEW_ONLY=$(python3 benchmarks/dist_info.py --new-only .base)
for round in 1 2; do
  PYTHONPATH=$BASE_PATH MINISGL_COMMIT=${BASE_COMMIT:-base} MINISGL_DISABLE_PLUGINS=$NEW_ONLY \
    step 110 python3 -m minisgl bench offline --output "$OUT" --label "offline-base-$round"
  PYTHONPATH=$NEW_PATH step 110 python3 -m minisgl bench offline --output "$OUT" --label "offline-new-$round"
done
# Grammar masks (structured output): cost per decode step, random weights of the shapes in .bench-model
# (a config.json and tokenizer files, carried; the demo model's by default).
[ -d .bench-model ] && PYTHONPATH=$NEW_PATH step 150 python3 benchmarks/structured_mask.py --dummy-from .bench-model \
  --device cuda --out "$OUT/structured_mask.json"
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
