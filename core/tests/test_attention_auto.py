"""``--attn auto`` skips a backend that cannot run the model (it raises ValueError when built)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.attention import AttentionContext
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
