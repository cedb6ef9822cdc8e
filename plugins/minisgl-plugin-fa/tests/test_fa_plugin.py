"""Registration, support checks and the choice between FlashAttention generations (any machine)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from minisgl_plugin_fa import support
from minisgl_plugin_fa.support import Unsupported, choose_generation, installed_generations

from minisgl.plugins import ComponentSpec, load_plugins

HOPPER, BLACKWELL, AMPERE, TURING = (9, 0), (10, 0), (8, 0), (7, 5)


def test_backends_are_registered_below_flashinfer_and_above_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = load_plugins(only=["builtin", "fa", "flashinfer"])
    fa = reg.get("attention", "fa")
    assert fa.aliases == ("flash-attn",) and reg.get("attention", "flash-attn") is fa
    for gen in (2, 3, 4):
        assert reg.provider("attention", f"fa{gen}").distribution == "minisgl-plugin-fa"
    # The order 'auto' tries where everything runs: FlashInfer first, then 'fa' (it picks the generation).
    monkeypatch.setattr(ComponentSpec, "unsupported_reason", lambda self, device: None)
    # (FlashInfer only where its plugin is installed: this package's own session has none.)
    flashinfer = ["flashinfer"] if reg.has("attention", "flashinfer") else []
    assert [s.name for s in reg.ranked("attention", "cuda")] == [*flashinfer, "fa", "fa2", "fa3", "fa4", "torch"]


def test_unsupported_on_cpu_with_the_reason() -> None:
    reg = load_plugins(only=["builtin", "fa"])
    for name in ("fa", "fa2", "fa3", "fa4"):
        reason = reg.get("attention", name).unsupported_reason("cpu")
        assert reason is not None and "NVIDIA GPUs (CUDA), not on cpu; use --attn torch" in reason
    assert reg.pick("attention", "auto", "cpu").name in ("cpu", "torch")  # cpu where its plugin is installed


def test_minisgl_plugins_lists_it_as_unsupported_on_cpu_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "plugins", "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listing = json.loads(out)
    plugin = next(p for p in listing["plugins"] if p["name"] == "fa")
    assert plugin["status"] == "active" and plugin["distribution"] == "minisgl-plugin-fa"
    rows = {r["name"]: r for r in listing["components"]["attention"] if r["plugin"] == "fa"}
    assert sorted(rows) == ["fa", "fa2", "fa3", "fa4"]
    assert all(not r["supported"] and "use --attn torch" in r["unsupported_reason"] for r in rows.values())


def test_entry_module_imports_neither_torch_nor_kernels() -> None:
    code = (
        "import sys; from minisgl.plugins import load_plugins; load_plugins(only=['builtin', 'fa']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'flash_attn', 'flash_attn_interface')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------- chooser


@pytest.mark.parametrize(
    "capability,installed,page_size,expected",
    [
        (HOPPER, {2, 3, 4}, 16, 3),  # FlashAttention 3 is written for Hopper
        (HOPPER, {4}, 16, 4),
        (HOPPER, {2, 4}, 256, 4),
        (HOPPER, {2}, 256, 2),
        (BLACKWELL, {2, 3, 4}, 1, 4),  # FlashAttention 3 does not run on Blackwell
        (BLACKWELL, {2, 3}, 512, 2),
        (AMPERE, {2, 3, 4}, 256, 2),  # FlashAttention 4 has no paged KV on sm80
        ((12, 0), {2, 4}, 256, 2),
        (HOPPER, {3, 4}, None, 3),
    ],
)
def test_choose_generation(
    capability: tuple[int, int], installed: set[int], page_size: int | None, expected: int
) -> None:
    assert choose_generation(capability, installed, page_size=page_size) == expected


def test_choose_a_pinned_generation() -> None:
    assert choose_generation(HOPPER, {3, 4}, wanted=4) == 4
    with pytest.raises(Unsupported, match=r"FlashAttention 3 does not read a paged KV cache on this GPU \(compute"):
        choose_generation(BLACKWELL, {3, 4}, wanted=3)


def test_choose_says_what_to_install() -> None:
    with pytest.raises(Unsupported) as info:
        choose_generation(HOPPER, set())
    msg = str(info.value)
    assert (
        "no FlashAttention package for this GPU (compute capability 9.0) is installed (installed generations: none)"
        in msg
    )
    assert "minisgl-plugin-fa[fa4]" in msg and "flash-attn>=2.6" in msg and "hopper/" in msg
    with pytest.raises(Unsupported, match=r"installed generations: 4\): pip install 'flash-attn"):
        choose_generation(AMPERE, {4})


def test_choose_rejects_small_pages_for_flash_attn_2_and_old_gpus() -> None:
    with pytest.raises(Unsupported, match="multiple of 256 tokens .the page size here is 16.; start with --page-size"):
        choose_generation(AMPERE, {2}, page_size=16)
    with pytest.raises(Unsupported, match=r"no FlashAttention generation reads a paged KV cache on this GPU \(compute"):
        choose_generation(TURING, {2, 3, 4})


# ------------------------------------------------------ is_supported on CUDA


def test_is_supported_on_cuda_follows_the_gpus_and_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "installed_generations", lambda: (4,))
    monkeypatch.setattr(support, "cuda_capabilities", lambda: [HOPPER])
    assert support.is_supported("cuda") and support.fa4_supported("cuda")
    with pytest.raises(Unsupported, match="installed generations: 4"):
        support.fa3_supported("cuda")
    monkeypatch.setattr(support, "cuda_capabilities", lambda: [HOPPER, AMPERE])  # every GPU must run it
    with pytest.raises(Unsupported, match="compute capability 8.0"):
        support.is_supported("cuda")
    monkeypatch.setattr(support, "cuda_capabilities", lambda: [])
    with pytest.raises(Unsupported, match="no CUDA GPU is visible"):
        support.is_supported("cuda")


def test_installed_generations_are_found_without_importing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = installed_generations()
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "flash_attn_interface.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    found = installed_generations()
    assert {3, 4} <= set(found) and set(before) <= set(found)
    assert "flash_attn.cute" not in sys.modules and "flash_attn_interface" not in sys.modules


def test_fp8_kv_cache_is_refused_with_the_reason() -> None:
    """No fa backend declares an FP8 KV cache (the engine refuses it at start-up by name); built directly over
    one, the backend says why and names the backend that reads it, before touching any GPU."""
    import torch
    from minisgl_plugin_fa.backend import FP8_KV_REFUSAL, FlashAttnBackend

    from minisgl.attention import AttentionContext
    from minisgl.kvcache import KVLayout, MHAKVPool

    reg = load_plugins(only=["builtin", "fa"])
    assert all(reg.get("attention", n).kv_cache_dtypes == () for n in ("fa", "fa2", "fa3", "fa4"))
    pool = MHAKVPool(KVLayout(1, 4, 16, 2, 64, torch.float8_e4m3fn, torch.device("cpu")))
    ctx = AttentionContext(4, 2, 64, 16, pool, torch.zeros(1, 64, dtype=torch.int32), 1, 64, torch.bfloat16,
                           torch.device("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="use --attn flashinfer for --kv-cache-dtype fp8_e4m3") as err:
        FlashAttnBackend(ctx)
    assert str(err.value) == FP8_KV_REFUSAL
