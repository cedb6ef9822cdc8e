#!/usr/bin/env bash
# One call on two lent H200s: KV-store kernel check, the offline benchmark at tp=1 (Qwen3-0.6B and
# Qwen3-8B shapes, random weights) and tp=2, and the tp=2 vs tp=1 agreement test. Results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/plugins/minisgl-plugin-llama/src:$PWD/plugins/minisgl-plugin-flashinfer/src:$PWD/tests
python3 - <<'PY'
import pathlib
dists = {"minisgl": ("builtin", "minisgl.plugins.builtin", ""),
         "minisgl_plugin_llama": ("llama", "minisgl_plugin_llama.plugin", "Requires-Dist: minisgl<0.2,>=0.1\n"),
         "minisgl_plugin_flashinfer": ("flashinfer", "minisgl_plugin_flashinfer.plugin", "Requires-Dist: minisgl<0.2,>=0.1\n")}
for dist, (entry, module, req) in dists.items():
    d = pathlib.Path(f"/tmp/site/{dist}-0.1.0.dist-info"); d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.1.0\n{req}")
    (d / "entry_points.txt").write_text(f"[minisgl]\n{entry} = {module}\n")
PY
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/log.txt
LIMIT=${LIMIT:-540}
step() { local t=$1; shift; local left=$((LIMIT - SECONDS)); [ $left -lt 30 ] && { echo "=== skipped: $*"; return; }
  [ $t -gt $left ] && t=$left; echo "=== $* (${t}s)" | tee -a $OUT/log.txt; timeout "$t" "$@" 2>&1 | tee -a $OUT/log.txt | grep -v Warning | tail -n 12; }
step 60 python3 - <<'PY'
import torch
from minisgl.kvcache import KVLayout, MHAKVPool
lay = KVLayout(2, 64, 16, 8, 128, torch.bfloat16, torch.device("cuda"))
a = MHAKVPool(lay); b = MHAKVPool(lay); b._store = None
qkv = torch.randn(300, 16 * 128 + 2 * 8 * 128, device="cuda", dtype=torch.bfloat16)
k = qkv[:, 2048:3072].view(-1, 8, 128); v = qkv[:, 3072:].view(-1, 8, 128)
loc = torch.randperm(64 * 16, device="cuda")[:300]
for layer in (0, 1):
    a.store_kv(k, v, loc, layer); b.store_kv(k, v, loc, layer)
ok = torch.equal(a._buffer, b._buffer)
print("RESULT store_kv triton == index_copy:", ok)
assert a._store is not None and ok
PY
B="python3 -m minisgl bench offline --output $OUT"
step 170 $B --label offline-gpu-storekv
step 150 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py
step 110 $B --tp 2 --label offline-gpu-tp2
C=core/src/minisgl/benchmark/configs/qwen3-8b.json
step 110 $B --model-config $C --label offline-8b-tp1
step 110 $B --model-config $C --tp 2 --label offline-8b-tp2
ls -la $OUT
