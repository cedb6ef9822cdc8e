"""Support checks that say why: ``Unsupported`` raised by ``is_supported``, in errors and in listings."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from minisgl.plugins import (
    AttentionBackendSpec,
    PluginRegistry,
    PluginSource,
    UnknownComponentError,
    hookimpl,
    load_plugins,
)
from minisgl.plugins.listing import main as listing_main
from minisgl.plugins.listing import render_table, to_json
from minisgl.plugins.specs import Unsupported

REASON = "needs compute capability 10.0 (this GPU is 9.0); use --attn flashinfer"


def needs_blackwell(device: str) -> bool:
    if device != "cuda":
        return False
    raise Unsupported(REASON)


def broken(device: str) -> bool:
    raise RuntimeError("driver library missing")


def attn(name: str, **kw: Any) -> AttentionBackendSpec:
    return AttentionBackendSpec(name=name, factory="minisgl.attention.torch_backend:TorchAttnBackend", **kw)


class KernelPlugin:
    """A plugin object (hooks as methods) with one backend per kind of check."""

    @hookimpl
    def minisgl_attention_backends(self) -> list[AttentionBackendSpec]:
        return [
            attn("bw", auto=True, priority=20, is_supported=needs_blackwell),
            attn("bw-lazy", auto=True, priority=19, is_supported=f"{__name__}:needs_blackwell"),
            attn("cudaonly", auto=True, priority=10, is_supported=lambda device: device == "cuda"),
            attn("broken", auto=True, priority=30, is_supported=broken),
        ]


def registry() -> PluginRegistry:
    return load_plugins(
        extra=[
            PluginSource("builtin", "minisgl.plugins.builtin", "minisgl", "0.1.0"),
            PluginSource("kern", KernelPlugin(), "minisgl-plugin-kern", "1.0"),
        ],
        environ={},
        discover_installed=False,
    )


def test_unsupported_reason_per_kind_of_check(caplog: pytest.LogCaptureFixture) -> None:
    reg = registry()
    assert reg.get("attention", "torch").unsupported_reason("cuda") is None  # no check: runs everywhere
    assert reg.get("attention", "bw").unsupported_reason("cuda") == REASON
    assert reg.get("attention", "bw-lazy").unsupported_reason("cuda:3") == REASON  # lazy check, device index dropped
    assert reg.get("attention", "bw").unsupported_reason("cpu") == ""  # plain False: no reason given
    assert reg.get("attention", "cudaonly").unsupported_reason("cuda") is None
    with caplog.at_level(logging.WARNING, logger="minisgl.plugins.specs"):
        why = reg.get("attention", "broken").unsupported_reason("cuda")
    assert why == "its is_supported check failed (RuntimeError: driver library missing)"
    assert "driver library missing" in caplog.text
    assert not reg.get("attention", "bw").supports("cuda")
    assert reg.get("attention", "cudaonly").supports("cuda")


def test_naming_an_unsupported_component_fails_with_its_reason() -> None:
    reg = registry()
    with pytest.raises(UnknownComponentError) as err:
        reg.pick("attention", "bw", "cuda")
    assert str(err.value) == (
        f"attention backend 'bw' does not support device 'cuda' ({REASON}); attention backends that do: cudaonly, torch"
    )
    # A check that just says no keeps the message without a reason.
    with pytest.raises(UnknownComponentError, match=r"^attention backend 'cudaonly' does not support device 'cpu'; "):
        reg.pick("attention", "cudaonly", "cpu")


def test_auto_skips_unsupported_components_without_raising() -> None:
    reg = registry()
    assert reg.pick("attention", "auto", "cuda").name == "cudaonly"  # bw/broken rank higher but cannot run
    assert reg.supported("attention", "cuda") == ["cudaonly", "torch"]


def test_json_listing_with_a_device_says_why() -> None:
    reg = registry()
    plain = to_json(reg)
    assert "device" not in plain
    assert all("supported" not in row for row in plain["components"]["attention"])
    data = to_json(reg, device="cuda")
    assert data["device"] == "cuda"
    rows = {row["name"]: row for row in data["components"]["attention"]}
    assert rows["bw"]["supported"] is False and rows["bw"]["unsupported_reason"] == REASON
    assert rows["torch"]["supported"] is True and rows["torch"]["unsupported_reason"] == ""
    assert rows["cudaonly"]["supported"] is True
    assert rows["broken"]["supported"] is False and "RuntimeError" in rows["broken"]["unsupported_reason"]
    assert all(row["supported"] for row in data["components"]["kv_pool"])


def test_table_listing_with_a_device_shows_one_line_per_unsupported_component() -> None:
    reg = registry()
    assert "unsupported" not in render_table(reg)
    table = render_table(reg, device="cuda")
    assert f"attention bw: unsupported on cuda: {REASON}" in table
    assert "attention cudaonly: unsupported" not in table
    on_cpu = render_table(reg, device="cpu")
    assert "attention cudaonly: unsupported on cpu\n" in on_cpu + "\n"  # no reason: nothing after the device
    assert "attention torch: unsupported" not in on_cpu


def test_listing_says_which_quantized_kv_caches_a_backend_reads() -> None:
    reg = registry()
    rows = {row["name"]: row for row in to_json(reg)["components"]["attention"]}
    assert rows["torch"]["kv_cache_dtypes"] == ["fp8_e4m3", "fp8_e5m2"] and rows["bw"]["kv_cache_dtypes"] == []
    table = render_table(reg)
    assert "torch (KV cache fp8_e4m3, fp8_e5m2)" in table and "bw (KV cache" not in table


def test_cli_device_flag() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert listing_main(["--json", "--device", "cpu"], stdout=out, stderr=err) == 0
    data = json.loads(out.getvalue())
    assert data["device"] == "cpu"
    torch_row = next(r for r in data["components"]["attention"] if r["name"] == "torch")
    assert torch_row["supported"] is True
