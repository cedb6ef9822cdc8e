"""Registration of the flashinfer backend: runs on any machine, CUDA or not."""

from __future__ import annotations

import sys

import pytest
import torch

from minisgl.plugins import ComponentSpec, load_plugins


def test_backend_is_registered_with_alias_and_ranked_first(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = load_plugins()
    spec = reg.get("attention", "flashinfer")
    assert spec.aliases == ("fi",)
    assert reg.get("attention", "fi") is spec
    assert reg.provider("attention", "flashinfer").name == "flashinfer"
    # Its hook is tryfirst: where every backend runs, 'auto' tries it before any other plugin's.
    monkeypatch.setattr(ComponentSpec, "unsupported_reason", lambda self, device: None)
    ranked = [s.name for s in reg.ranked("attention", "cuda")]
    assert ranked[0] == "flashinfer" and ranked[-1] == "torch"  # the core's reference, trylast
    # It reads both FP8 KV cache dtypes (and decodes them itself unless a backend asks to).
    assert spec.kv_cache_dtypes == ("fp8_e4m3", "fp8_e5m2") and spec.decode_kv_cache_dtypes == ()


def test_not_supported_on_cpu_and_auto_falls_back_to_torch() -> None:
    reg = load_plugins()
    assert not reg.get("attention", "flashinfer").supports("cpu")
    assert reg.pick("attention", "auto", "cpu").name in ("cpu", "torch")  # cpu where its plugin is installed
    assert "flashinfer" not in reg.supported("attention", "cpu")


def test_loading_the_entry_module_does_not_import_flashinfer() -> None:
    before = "flashinfer" in sys.modules
    load_plugins()
    assert ("flashinfer" in sys.modules) == before


def test_auto_picks_flashinfer_on_cuda_when_installed() -> None:
    import importlib.util

    reg = load_plugins()
    if torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None:
        assert reg.pick("attention", "auto", "cuda").name == "flashinfer"
    else:
        assert reg.get("attention", "flashinfer").supports("cuda") == (
            importlib.util.find_spec("flashinfer") is not None
        )


def test_backend_switches_read_on_off_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl_plugin_flashinfer.backend import _flag_from_env

    name = "MINISGL_FLASHINFER_RAGGED"
    monkeypatch.delenv(name, raising=False)
    assert _flag_from_env(name) is None

    def read(value: str) -> bool | None:
        monkeypatch.setenv(name, value)
        return _flag_from_env(name)

    assert [read(v) for v in ("", "auto", " AUTO ")] == [None] * 3
    assert [read(v) for v in ("1", "true", "on")] == [True] * 3
    assert [read(v) for v in ("0", "false", "off")] == [False] * 3
    monkeypatch.setenv("MINISGL_FLASHINFER_TENSOR_CORES", "maybe")
    with pytest.raises(ValueError, match=r"MINISGL_FLASHINFER_TENSOR_CORES='maybe': expected 1, 0 or auto"):
        _flag_from_env("MINISGL_FLASHINFER_TENSOR_CORES")


def test_ragged_split_takes_the_trailing_prompts_with_nothing_cached() -> None:
    from minisgl_plugin_flashinfer.backend import ragged_split

    from minisgl.core import Req, SamplingParams

    def reqs(cached: list[int]) -> list[Req]:
        out = []
        for i, c in enumerate(cached):
            r = Req(rid=i, input_ids=[0] * (c + 4), params=SamplingParams(), max_new_tokens=1)
            r.cached_len, r.device_len = c, c + 4
            out.append(r)
        return out

    assert ragged_split(reqs([])) == 0
    assert ragged_split(reqs([0, 0, 0])) == 0
    assert ragged_split(reqs([12, 7, 0, 0])) == 2
    assert ragged_split(reqs([0, 7, 0])) == 2  # a fresh prompt before a cached row stays paged
    assert ragged_split(reqs([3, 0, 5])) == 3


def test_ragged_prefill_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default (it made --attn auto's FlashInfer + XQA pair 2.7x slower over an FP8 cache); the
    environment turns it on for every engine, an explicit argument wins over both."""
    from minisgl_plugin_flashinfer.backend import ragged_prefill_setting

    monkeypatch.delenv("MINISGL_FLASHINFER_RAGGED", raising=False)
    assert ragged_prefill_setting(None) is False
    assert ragged_prefill_setting(True) is True
    monkeypatch.setenv("MINISGL_FLASHINFER_RAGGED", "auto")
    assert ragged_prefill_setting(None) is False
    monkeypatch.setenv("MINISGL_FLASHINFER_RAGGED", "1")
    assert ragged_prefill_setting(None) is True
    assert ragged_prefill_setting(False) is False
    monkeypatch.setenv("MINISGL_FLASHINFER_RAGGED", "0")
    assert ragged_prefill_setting(None) is False


def test_decode_rows_counts_the_leading_one_token_rows() -> None:
    from minisgl_plugin_flashinfer.backend import decode_rows

    from minisgl.core import Req, SamplingParams

    def reqs(rows: list[tuple[int, int]]) -> list[Req]:
        out = []
        for i, (cached, new) in enumerate(rows):
            r = Req(rid=i, input_ids=[0] * (cached + new), params=SamplingParams(), max_new_tokens=1)
            r.cached_len, r.device_len = cached, cached + new
            out.append(r)
        return out

    assert decode_rows(reqs([])) == 0
    assert decode_rows(reqs([(9, 1), (30, 1), (5, 64), (0, 1)])) == 2
    assert decode_rows(reqs([(0, 1), (9, 1)])) == 2  # a one-token prompt attends over its own K/V alone
    assert decode_rows(reqs([(9, 1), (9, 2), (9, 1)])) == 1  # only the leading run
