"""``--attn auto`` skips a backend that cannot run the model (it raises ValueError when built), and decodes a
KV cache with the backend that asks to decode that dtype (``decode_kv_cache_dtypes``)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.attention import AttentionContext, HybridAttnBackend, TorchAttnBackend
from minisgl.core import Batch, ValidationError
from minisgl.plugins import AttentionBackendSpec, PluginSource, hookimpl, load_plugins
from minisgl.testing.registry import TEST_MODELS_PLUGIN, _test_models_plugin


def _picky(ctx: AttentionContext) -> object:
    raise ValueError(f"picky backend: head_dim {ctx.head_dim} is not supported (expected 512)")


def _registry():  # noqa: ANN202
    module = types.ModuleType("minisgl_picky_attention")

    @hookimpl
    def minisgl_attention_backends() -> list[AttentionBackendSpec]:
        return [AttentionBackendSpec(name="picky", factory=_picky, auto=True, priority=1000)]

    module.minisgl_attention_backends = minisgl_attention_backends  # type: ignore[attr-defined]
    extra = [
        PluginSource("picky", module, "minisgl-plugin-picky", "1.0"),
        PluginSource(TEST_MODELS_PLUGIN, _test_models_plugin()),
    ]
    return load_plugins(only=["builtin", "picky", TEST_MODELS_PLUGIN], extra=extra, environ={})


def test_auto_falls_back_past_a_backend_that_rejects_the_model(tiny_dir: Path, caplog: pytest.LogCaptureFixture):
    reg = _registry()
    assert reg.pick("attention", "auto", "cpu").name == "picky"  # the best ranked one...
    with caplog.at_level("INFO", logger="minisgl.engine.engine"):
        llm = LLM(str(tiny_dir), registry=reg, attention_backend="auto", page_size=4)
    try:
        # ...cannot run it: the next one does (cpu where the C kernels build, else the torch reference).
        assert [s.name for s in llm.engine.attn_specs] in (["cpu"], ["torch"])
        assert "picky backend: head_dim" in caplog.text
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(out[0].token_ids) == 4
        llm.check_accounting()
    finally:
        llm.close()


def test_a_named_backend_that_rejects_the_model_is_an_error(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="picky backend: head_dim"):
        LLM(str(tiny_dir), registry=_registry(), attention_backend="picky", page_size=4)
    # PREFILL,DECODE: "auto" falls back per position, a named one does not.
    with pytest.raises(ValueError, match="picky backend"):
        LLM(str(tiny_dir), registry=_registry(), attention_backend="auto,picky", page_size=4)


# ------------------------------------------------------------------ a backend that decodes an FP8 cache best
class _Decoder(TorchAttnBackend):
    """The reference, counting the decode batches it runs."""

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        self.decodes = 0

    def prepare_metadata(self, batch: Batch) -> None:
        self.decodes += int(not batch.is_prefill)
        super().prepare_metadata(batch)


def _rejecting_decoder(ctx: AttentionContext) -> object:
    raise ValueError("fp8 decoder: this GPU cannot run it")


def _decoder_registry(factory: object = _Decoder):  # noqa: ANN202
    module = types.ModuleType("minisgl_fp8_decoder")

    @hookimpl
    def minisgl_attention_backends() -> list[AttentionBackendSpec]:
        # Ranked last, so 'auto' prefills with the reference and decodes an FP8 cache with this one.
        spec = AttentionBackendSpec(
            name="fp8-decoder", factory=factory, auto=True, priority=-1000,
            kv_cache_dtypes=("fp8_e4m3",), decode_kv_cache_dtypes=("fp8_e4m3",),
        )  # fmt: skip
        return [spec]

    module.minisgl_attention_backends = minisgl_attention_backends  # type: ignore[attr-defined]
    extra = [PluginSource("fp8-decoder", module), PluginSource(TEST_MODELS_PLUGIN, _test_models_plugin())]
    return load_plugins(only=["builtin", "fp8-decoder", TEST_MODELS_PLUGIN], extra=extra, environ={})


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def test_auto_decodes_an_fp8_cache_with_the_backend_that_asks_for_it(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = _decoder_registry()
    with LLM(str(tiny_dir), registry=reg, attention_backend="torch", page_size=4, kv_cache_dtype="fp8_e4m3") as ref:
        want = [o.token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with caplog.at_level("INFO", logger="minisgl.engine.engine"):
        llm = LLM(str(tiny_dir), registry=reg, attention_backend="auto", page_size=4, kv_cache_dtype="fp8_e4m3")
    with llm:
        attn = llm.engine.attn
        assert isinstance(attn, HybridAttnBackend) and isinstance(attn.decode, _Decoder)
        assert [s.name for s in llm.engine.attn_specs] == ["torch", "fp8-decoder"]
        assert "torch prefills, fp8-decoder decodes the fp8_e4m3 KV cache" in caplog.text
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        assert attn.decode.decodes > 0
        llm.check_accounting()


def test_auto_keeps_one_backend_for_other_caches_and_named_backends(tiny_dir: Path) -> None:
    reg = _decoder_registry()
    for kw in (
        {"attention_backend": "auto"},
        {"attention_backend": "torch", "kv_cache_dtype": "fp8_e4m3"},
        {"attention_backend": "auto", "kv_cache_dtype": "fp8_e5m2"},  # the decoder asks for e4m3 only
    ):
        with LLM(str(tiny_dir), registry=reg, page_size=4, **kw) as llm:  # type: ignore[arg-type]
            assert [s.name for s in llm.engine.attn_specs] == ["torch"], kw
            assert not isinstance(llm.engine.attn, HybridAttnBackend)
    # Named over a cache it does not read: refused, naming the backends that read it.
    with pytest.raises(
        ValidationError, match="fp8-decoder.* cannot read a fp8_e5m2 KV cache; installed backends that can: torch"
    ):
        LLM(str(tiny_dir), registry=reg, page_size=4, attention_backend="fp8-decoder", kv_cache_dtype="fp8_e5m2")


def test_auto_decodes_with_the_prefill_backend_when_the_decoder_cannot_run(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = _decoder_registry(_rejecting_decoder)
    with caplog.at_level("INFO", logger="minisgl.engine.engine"):
        llm = LLM(str(tiny_dir), registry=reg, page_size=4, kv_cache_dtype="fp8_e4m3")
    with llm:
        assert [s.name for s in llm.engine.attn_specs] == ["torch"]
        assert "fp8-decoder cannot decode this model (fp8 decoder: this GPU cannot run it)" in caplog.text
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].token_ids) == 6


def test_a_backend_decodes_only_a_cache_it_reads() -> None:
    with pytest.raises(ValueError, match="decode_kv_cache_dtypes names fp8_e4m3, which kv_cache_dtypes does not"):
        AttentionBackendSpec(name="x", factory=_Decoder, decode_kv_cache_dtypes=("fp8_e4m3",))
    with pytest.raises(TypeError, match="decode_kv_cache_dtypes must be a tuple of strings"):
        AttentionBackendSpec(name="x", factory=_Decoder, kv_cache_dtypes=("fp8_e4m3",), decode_kv_cache_dtypes="fp8")  # type: ignore[arg-type]
