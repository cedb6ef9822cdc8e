"""The conformance kit run against the built-in components: the torch attention backend and the mha pool."""

from __future__ import annotations

import pytest
import torch

from minisgl.attention import AttentionContext, BaseAttnBackend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch
from minisgl.plugins import PluginRegistry, load_plugins
from minisgl.testing.attention import (
    ATTN_CASES,
    AttentionBackendConformance,
    AttentionHarness,
    AttnCase,
    reference_attention,
)
from minisgl.testing.kv_pool import KVPoolConformance


def _builtin_only() -> PluginRegistry:
    return load_plugins(only=["builtin"])


class TestTorchBackendConformance(AttentionBackendConformance):
    backend = "torch"

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


class TestTorchBackendBFloat16(AttentionBackendConformance):
    """The reference in bfloat16 (a smaller matrix: the float32 class covers the shapes)."""

    backend = "torch"
    dtype = torch.bfloat16
    head_dims = (128,)
    gqa_ratios = (4,)

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


class TestTorchBackendFP8KV(AttentionBackendConformance):
    """The reference over an FP8 KV cache with per-layer scales: de-quantized on read, checked against float64
    math over the de-quantized K/V and within QUANTIZED_KV_TOLERANCE of the unquantized K/V."""

    backend = "torch"
    kv_cache_dtype = "fp8_e4m3"
    head_dims = (64,)

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


class TestTorchBackendBFloat16FP8KV(AttentionBackendConformance):
    backend = "torch"
    dtype = torch.bfloat16
    kv_cache_dtype = "fp8_e4m3"
    head_dims = (128,)
    gqa_ratios = (2,)

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


@pytest.mark.cuda
class TestTorchBackendCUDAFP8KV(AttentionBackendConformance):
    backend = "torch"
    device = "cuda"
    dtype = torch.bfloat16
    kv_cache_dtype = "fp8_e4m3"

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


@pytest.mark.cuda
class TestTorchBackendCUDABFloat16(AttentionBackendConformance):
    """The reference on a GPU in the dtype GPUs serve in (skipped without CUDA)."""

    backend = "torch"
    device = "cuda"
    dtype = torch.bfloat16

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


@pytest.mark.cuda
class TestMHAPoolCUDA(KVPoolConformance):
    pool = "mha"
    device = "cuda"
    dtype = torch.bfloat16

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


class TestMHAPoolConformance(KVPoolConformance):
    pool = "mha"

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


class TestMHAPoolBFloat16(KVPoolConformance):
    pool = "mha"
    dtype = torch.bfloat16
    page_sizes = (16,)

    def load_registry(self) -> PluginRegistry:
        return _builtin_only()


# The kit must catch broken backends, or passing it means nothing. Each of these
# backends has one realistic bug; the harness has to reject every one of them.


class _WrongLayer(TorchAttnBackend):
    """Stores every layer's K/V into layer 0."""

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        return super().forward(q, k, v, 0, batch)


class _PaddedBackend(TorchAttnBackend):
    """The reference's one padded path, whose mask the broken backends below edit."""


class _IgnoresCachedPrefix(_PaddedBackend):
    """Attends only to the new tokens, forgetting the KV already in the cache."""

    def prepare_metadata(self, batch: Batch) -> None:
        super().prepare_metadata(batch)
        for i, r in enumerate(batch.reqs):
            batch.attn_metadata.mask[i, :, :, : r.cached_len] = False


class _NoCausalMask(_PaddedBackend):
    """Lets every new token see every other new token of its request."""

    def prepare_metadata(self, batch: Batch) -> None:
        super().prepare_metadata(batch)
        meta = batch.attn_metadata
        kv_lens = torch.tensor([r.device_len for r in batch.reqs]).view(-1, 1, 1, 1)
        meta.mask[:] = torch.arange(meta.mask.shape[-1]).view(1, 1, 1, -1) < kv_lens


class _WrongGQAGrouping(TorchAttnBackend):
    """Maps query head h to KV head h % kv_heads instead of h // group."""

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        ctx = self.ctx
        if ctx.num_qo_heads == ctx.num_kv_heads:
            return super().forward(q, k, v, layer_id, batch)
        group = ctx.num_qo_heads // ctx.num_kv_heads
        perm = torch.arange(ctx.num_qo_heads).view(group, ctx.num_kv_heads).t().reshape(-1)
        inv = torch.argsort(perm)
        qh = q.view(-1, ctx.num_qo_heads, ctx.head_dim)[:, perm].reshape(q.shape)
        out = super().forward(qh, k, v, layer_id, batch)
        return out.view(-1, ctx.num_qo_heads, ctx.head_dim)[:, inv].reshape(out.shape)


class _DropsLastRow(TorchAttnBackend):
    """Leaves the last output row unwritten (uninitialised memory)."""

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        out = super().forward(q, k, v, layer_id, batch).clone()
        out[-1] = float("nan")
        return out


class _WritesNeighbourSlot(TorchAttnBackend):
    """Writes K/V one slot past where out_loc says, as an off-by-one store kernel would."""

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        ctx = self.ctx
        ctx.kv_pool.store_kv(
            k.view(-1, ctx.num_kv_heads, ctx.head_dim),
            v.view(-1, ctx.num_kv_heads, ctx.head_dim),
            (batch.out_loc + 1) % ctx.kv_pool.layout.num_slots,
            layer_id,
        )
        return super().forward(q, k, v, layer_id, batch)


class _IgnoresKVScales(TorchAttnBackend):
    """Reads a quantized cache without its scales (only wrong with an FP8 cache)."""

    def gather_kv(self, layer_id, slots, dtype):  # type: ignore[no-untyped-def]
        pool, hkv, d = self.ctx.kv_pool, self.ctx.num_kv_heads, self.ctx.head_dim
        k, v = (c.reshape(-1, hkv, d).view(torch.uint8) for c in (pool.k_cache(layer_id), pool.v_cache(layer_id)))
        return (t.index_select(0, slots).view(pool.layout.dtype).to(dtype) for t in (k, v))


class _FreshOverOwnKV(TorchAttnBackend):
    """Stores everything, but attends prompts with nothing cached over their new K/V as given (unquantized), as
    a ragged prefill kernel does: allowed over a quantized cache."""

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        out = super().forward(q, k, v, layer_id, batch).clone()
        hq, hkv, d = self.ctx.num_qo_heads, self.ctx.num_kv_heads, self.ctx.head_dim
        start = 0
        for r in batch.reqs:
            n = r.extend_len
            if r.cached_len == 0:
                rows = slice(start, start + n)
                qr, kr, vr = (x[rows].reshape(n, -1, d) for x in (q, k, v))
                assert kr.shape[1] == hkv
                own = reference_attention(qr, kr, vr, 0, self.ctx.scale)
                out[rows] = own.reshape(n, hq * d).to(out.dtype)
            start += n
        return out


class _FreshNotStored(_FreshOverOwnKV):
    """Attends fresh prompts over their own K/V but leaves their slots unwritten (zeros)."""

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        out = super().forward(q, k, v, layer_id, batch)
        start, pool = 0, self.ctx.kv_pool
        for r in batch.reqs:
            if r.cached_len == 0:
                loc = batch.out_loc[start : start + r.extend_len]
                for cache in (pool.k_cache(layer_id), pool.v_cache(layer_id)):
                    flat = cache.view(-1, self.ctx.num_kv_heads, self.ctx.head_dim).view(torch.uint8)
                    flat[loc] = 0
            start += r.extend_len
        return out


BROKEN: dict[str, type[BaseAttnBackend]] = {
    "wrong-layer": _WrongLayer,
    "ignores-cached-prefix": _IgnoresCachedPrefix,
    "no-causal-mask": _NoCausalMask,
    "wrong-gqa-grouping": _WrongGQAGrouping,
    "drops-last-row": _DropsLastRow,
    "writes-neighbour-slot": _WritesNeighbourSlot,
}


BROKEN_FP8: dict[str, type[BaseAttnBackend]] = {
    "ignores-kv-scales": _IgnoresKVScales,
    "fresh-prompts-not-stored": _FreshNotStored,
}


def _run_all_scenarios(factory, kv_cache_dtype: str = "auto") -> None:  # type: ignore[no-untyped-def]
    kit = AttentionBackendConformance()
    kit.backend = factory  # type: ignore[assignment]
    kit.kv_cache_dtype = kv_cache_dtype
    kit.load_registry = _builtin_only  # type: ignore[method-assign]
    case = next(c for c in ATTN_CASES if c.page_size == 16 and c.gqa == 2 and c.head_dim == 64)
    for test in (
        kit.test_prefill_mixed_lengths,
        kit.test_extend_on_cached_prefix,
        kit.test_decode,
        kit.test_reused_pages_hold_stale_kv,
    ):
        test(case)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_kit_rejects_broken_backend(name: str) -> None:
    with pytest.raises(AssertionError):
        _run_all_scenarios(BROKEN[name])


@pytest.mark.parametrize("name", sorted(BROKEN_FP8))
def test_kit_rejects_broken_fp8_backend(name: str) -> None:
    with pytest.raises(AssertionError):
        _run_all_scenarios(BROKEN_FP8[name], "fp8_e4m3")
    _run_all_scenarios(TorchAttnBackend, "fp8_e4m3")  # the same scenarios pass with the reference


def test_kit_lets_fresh_prompts_attend_over_their_own_kv_over_a_quantized_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _run_all_scenarios(_FreshOverOwnKV, "fp8_e4m3")
    # Without the allowance those rows differ from the reference reading the FP8 cache: the kit relied on it.
    monkeypatch.setattr(AttentionHarness, "_fresh_unquantized", lambda self, *args: None)
    with pytest.raises(AssertionError, match="differ from the torch reference"):
        _run_all_scenarios(_FreshOverOwnKV, "fp8_e4m3")


def test_harness_reports_request_and_position() -> None:
    """A failure names the step, layer, request and position of the bad row."""
    from minisgl.kvcache import MHAKVPool

    case = ATTN_CASES[0]
    h = AttentionHarness(_DropsLastRow, MHAKVPool, case)
    reqs = [h.add_request(3), h.add_request(5)]
    with pytest.raises(
        AssertionError,
        match=r"step 0 \(prefill, 2 requests, 8 tokens\), layer 0: NaN/inf in output "
        r"rows row 7 = request 1 position 4",
    ):
        h.step([(r, r.prompt_len) for r in reqs])


def test_context_matches_engine_fields() -> None:
    """The harness builds the AttentionContext the engine builds: a device table apart from the manager's."""
    from minisgl.kvcache import MHAKVPool

    h = AttentionHarness(TorchAttnBackend, MHAKVPool, ATTN_CASES[0])
    assert isinstance(h.ctx, AttentionContext)
    assert h.ctx.page_table is h.page_table and h.page_table is not h.manager.table
    assert h.ctx.max_seq_len == h.manager.max_seq_len == h.page_table.shape[1]


class _RecordsTable(TorchAttnBackend):
    """Records, per batch, the page-table rows it was given for each request's tokens."""

    seen: list[list[list[int]]] = []

    def prepare_metadata(self, batch: Batch) -> None:
        super().prepare_metadata(batch)
        _RecordsTable.seen.append([self.ctx.page_table[r.table_idx, : r.device_len].tolist() for r in batch.reqs])


@pytest.mark.parametrize("page_size", [1, 4])
def test_kit_runs_the_production_page_table_path(page_size: int) -> None:
    """The backend reads only what StepInputs mirrored from the manager's new entries (the engine's path):
    prefix-cache slots written before the first step, chunks, decode across pages, a reused row."""
    from minisgl.kvcache import MHAKVPool

    _RecordsTable.seen = []
    h = AttentionHarness(_RecordsTable, MHAKVPool, AttnCase(page_size, 2, 64))
    hit = h.add_request(2 * page_size + 5, cached_prefix=2 * page_size)
    other = h.add_request(9)
    assert not h.page_table.any(), "the device table changes only when a step is launched"
    plan = [[(hit, 5), (other, 4)], [(other, 5)], [(hit, 1), (other, 1)], [(hit, 1), (other, 1)]]
    for step in plan:
        h.step(step)
        rows = [h.manager.table[r.table_idx, : r.device_len].tolist() for r, _ in step]
        assert _RecordsTable.seen[-1] == rows
    h.release(other)
    fresh = h.add_request(3)
    assert fresh.table_idx == 1  # other's row, reused: its stale entries are overwritten
    h.step([(fresh, 3), (hit, 1)])
    assert _RecordsTable.seen[-1][0] == h.manager.table[1, :3].tolist()


class _AttendsStored(TorchAttnBackend):
    """The reference, advertising its attend_stored: the kit runs odd layers of prefill steps through it."""

    supports_attend_stored = True


class _AttendStoredLeavesOutput(_AttendsStored):
    def attend_stored(self, q, k, v, layer_id, batch, out):  # type: ignore[no-untyped-def]
        pass  # the given buffer keeps its NaN


class _AttendStoredStoresAgain(_AttendsStored):
    def attend_stored(self, q, k, v, layer_id, batch, out):  # type: ignore[no-untyped-def]
        # Stores the wrong layer's K/V on top of what the pool already holds.
        hkv, d = self.ctx.num_kv_heads, self.ctx.head_dim
        self.ctx.kv_pool.store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), batch.out_loc, 1 - layer_id)
        super().attend_stored(q, k, v, layer_id, batch, out)


class _AttendStoredShiftsRows(_AttendsStored):
    def attend_stored(self, q, k, v, layer_id, batch, out):  # type: ignore[no-untyped-def]
        super().attend_stored(q, k, v, layer_id, batch, out)
        out.copy_(out.roll(1, dims=0))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_kit_runs_attend_stored_of_a_backend_that_supports_it(kv_cache_dtype: str) -> None:
    calls: list[int] = []

    class Counted(_AttendsStored):
        def attend_stored(self, q, k, v, layer_id, batch, out):  # type: ignore[no-untyped-def]
            calls.append(layer_id)
            super().attend_stored(q, k, v, layer_id, batch, out)

    _run_all_scenarios(Counted, kv_cache_dtype)
    assert calls and set(calls) == {1}  # the odd layer of every prefill step; the even one runs forward


@pytest.mark.parametrize("broken", [_AttendStoredLeavesOutput, _AttendStoredStoresAgain, _AttendStoredShiftsRows])
def test_kit_rejects_broken_attend_stored(broken: type) -> None:
    with pytest.raises(AssertionError):
        _run_all_scenarios(broken)


class TestTorchBackendE5M2KV(TestTorchBackendFP8KV):
    kv_cache_dtype = "fp8_e5m2"


class TestTorchBackendBFloat16E5M2KV(TestTorchBackendBFloat16FP8KV):
    kv_cache_dtype = "fp8_e5m2"
