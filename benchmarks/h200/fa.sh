#!/usr/bin/env bash
# H200 session, call 3 of 3 (on the machine still warm from suite.sh, whose /tmp holds the first part
# of FlashAttention 4's compiler): installs FlashAttention 4, then the offline workload with
# --attn fa, fa,flashinfer and flashinfer side by side, the kernel-level comparison of prefill and
# decode, and the fa plugin's GPU tests. Carry plugins/minisgl-plugin-fa/build/gpu-b.
set -uo pipefail
export LIMIT=${LIMIT:-520}
source benchmarks/h200/setup.sh
b=plugins/minisgl-plugin-fa/build/gpu-b fa_site=/tmp/site-fa
cat /tmp/fa-stage/cu13.part0 $b/cu13.part[1-9] > /tmp/fa-stage/dsl.tar.xz
(cd /tmp/fa-stage && sed 's/ .*/  dsl.tar.xz/' "$OLDPWD/$b/SHA256SUMS" | sha256sum -c) 2>&1 | tee -a "$OUT/log.txt"
rm -rf $fa_site && mkdir -p $fa_site
for w in $b/*.whl; do python3 -m zipfile -e "$w" $fa_site; done
python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" /tmp/fa-stage/dsl.tar.xz $fa_site
python3 -c "import cuda.bindings.driver" 2>/dev/null || for w in $b/fallback/*.whl; do python3 -m zipfile -e "$w" $fa_site; done
export PYTHONPATH=$fa_site:$fa_site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa-cute-cache
step 60 python3 -c "import flash_attn.cute, minisgl_plugin_fa.support as s; print('fa4 ok', s.installed_generations())"
python3 -m minisgl plugins --device cuda > "$OUT/plugins-fa.txt" 2>&1
for attn in fa fa,flashinfer flashinfer; do
  step 90 python3 -m minisgl bench offline --attn $attn --output "$OUT" --label "offline-attn-${attn/,/-}"
done
step 120 python3 plugins/minisgl-plugin-fa/gpu/bench_kernels.py --backends fa,flashinfer --out "$OUT/fa_kernels.json"
LEFT=$((LIMIT - SECONDS - 15))
python3 tests/gpu_suite.py --require-cuda --out "$OUT/fa-suite" --total-timeout $LEFT --file-timeout $LEFT \
  --commit "${MINISGL_COMMIT:-unknown}" plugins/minisgl-plugin-fa/tests/test_fa_gpu.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 15
tar czf "$OUT/fa-logs.tgz" -C "$OUT/fa-suite" logs && rm -rf "$OUT/fa-suite/logs"
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
