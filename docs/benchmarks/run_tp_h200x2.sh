#!/usr/bin/env bash
# One call on two lent H200s: KV-store kernel check, the offline benchmark at tp=1 (Qwen3-0.6B and
# Qwen3-8B shapes, random weights) and tp=2, and the tp=2 vs tp=1 agreement test. Results go to $OUT.
set -uo pipefail
LIMIT=${LIMIT:-540}
source docs/benchmarks/h200_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/log.txt
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
