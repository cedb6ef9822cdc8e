#!/usr/bin/env bash
# One call on a lent H200 (issue: FP8): FP8 mixture-of-experts. The fused backend's GPU tests (FP8 kernels at
# Qwen3-30B-A3B's shapes, an FP8 Qwen3-MoE checkpoint eager and under CUDA graphs), then one Qwen3-30B-A3B MoE
# layer timed in bf16 and with FP8 experts, block scales and per-row scales (moe_layer.py --fp8), each beside
# bf16 on the same de-quantized weights. Carry .whl; MINISGL_COMMIT names the commit.
# Results in $OUT: moe-fp8-block.{json,md}, moe-fp8-row.{json,md}, logs.tgz.
set -uo pipefail
export LIMIT=${LIMIT:-480}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
step 200 python3 -m pytest -q -s -p no:cacheprovider plugins/minisgl-plugin-qwen3-moe/tests/test_fused_cuda.py \
  plugins/minisgl-plugin-fp8/tests/test_fp8_gpu.py -k "fp8_experts or fp8_moe"
L=plugins/minisgl-plugin-qwen3-moe/benchmarks/moe_layer.py
for kind in block row; do
  step 120 python3 $L --fp8 $kind --commit "${MINISGL_COMMIT:-unknown}" --json $OUT/moe-fp8-$kind.json --md $OUT/moe-fp8-$kind.md
done
finish
