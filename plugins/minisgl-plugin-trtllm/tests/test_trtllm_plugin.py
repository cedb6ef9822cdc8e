"""Registration and device support of the trtllm backends: runs on any machine, GPU or not.

The GPU generation is faked by replacing ``support.cuda_capabilities``
(and whether FlashInfer is installed), so every answer for Hopper, Blackwell and
older GPUs is checked here, including how ``minisgl plugins`` and ``minisgl serve``
report it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from minisgl_plugin_trtllm import support

from minisgl.plugins import ComponentSpec, UnknownComponentError, Unsupported, load_plugins
from minisgl.plugins.listing import render_table, to_json

HOPPER, B200, B300, RTX5090, A100 = (9, 0), (10, 0), (10, 3), (12, 0), (8, 0)


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The faked visible GPUs (edit the list in the test); FlashInfer counts as installed."""
    caps: list[tuple[int, int]] = []
    monkeypatch.setattr(support, "cuda_capabilities", lambda: list(caps))
    monkeypatch.setattr(support, "flashinfer_installed", lambda: True)
    return caps


def test_both_backends_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = load_plugins(only=["builtin", "flashinfer", "trtllm"])
    xqa = reg.get("attention", "trtllm-xqa")
    assert reg.get("attention", "xqa") is xqa
    assert reg.provider("attention", "trtllm").distribution == "minisgl-plugin-trtllm"
    # 'auto' ranks them below flashinfer and above the built-ins, trtllm-gen before XQA.
    monkeypatch.setattr(ComponentSpec, "unsupported_reason", lambda self, device: None)
    # (FlashInfer only where its plugin is installed: this package's own session has none.)
    flashinfer = ["flashinfer"] if reg.has("attention", "flashinfer") else []
    assert [s.name for s in reg.ranked("attention", "cuda")] == [*flashinfer, "trtllm", "trtllm-xqa", "torch"]


def test_entry_and_support_modules_import_neither_torch_nor_flashinfer() -> None:
    code = (
        "import sys\n"
        "import minisgl_plugin_trtllm.plugin, minisgl_plugin_trtllm.support\n"
        "from minisgl.plugins import load_plugins\n"
        "load_plugins()\n"
        "print(sorted(m for m in ('torch', 'flashinfer') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("caps", "gen_ok", "xqa_ok"),
    [
        ([B200], True, True),
        ([B300, B300], True, True),
        ([HOPPER], False, True),
        ([RTX5090], False, True),
        ([A100], False, False),
        ([B200, HOPPER], False, True),  # every visible GPU must qualify
    ],
)
def test_support_by_compute_capability(
    gpus: list[tuple[int, int]], caps: list[tuple[int, int]], gen_ok: bool, xqa_ok: bool
) -> None:
    gpus.extend(caps)
    reg = load_plugins()
    assert reg.get("attention", "trtllm").supports("cuda") is gen_ok
    assert reg.get("attention", "trtllm-xqa").supports("cuda") is xqa_ok
    assert not reg.get("attention", "trtllm").supports("cpu")


def test_hopper_reason_names_the_gpu_and_the_way_out(gpus: list[tuple[int, int]]) -> None:
    gpus.append(HOPPER)
    with pytest.raises(Unsupported) as err:
        support.trtllm_gen_supported("cuda")
    text = str(err.value)
    assert "10.0 or 10.3" in text and "GPU is 9.0" in text
    assert "--attn flashinfer,trtllm-xqa" in text  # XQA runs here: the reason offers it
    assert support.xqa_supported("cuda") is True


def test_reasons_on_older_gpus_cpu_and_without_flashinfer(
    gpus: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus.append(A100)
    with pytest.raises(Unsupported, match=r"GPU is 8\.0; use --attn flashinfer$"):
        support.trtllm_gen_supported("cuda")  # no XQA hint: XQA does not run on 8.0 either
    with pytest.raises(Unsupported, match=r"XQA decode kernel runs on compute capability 9\.x, 10\.x or 12\.x"):
        support.xqa_supported("cuda")
    with pytest.raises(Unsupported, match="need a CUDA GPU; use --attn torch"):
        support.xqa_supported("cpu")
    gpus.clear()
    with pytest.raises(Unsupported, match="no CUDA GPU is visible"):
        support.xqa_supported("cuda")
    monkeypatch.setattr(support, "flashinfer_installed", lambda: False)
    with pytest.raises(Unsupported, match=r"FlashInfer.*is not installed: pip install 'minisgl-plugin-trtllm\[cuda\]'"):
        support.trtllm_gen_supported("cuda")


def test_naming_trtllm_on_hopper_fails_with_the_reason(gpus: list[tuple[int, int]]) -> None:
    gpus.append(HOPPER)
    reg = load_plugins()
    with pytest.raises(UnknownComponentError) as err:
        reg.pick("attention", "trtllm", "cuda")
    assert "attention backend 'trtllm' does not support device 'cuda' (TensorRT-LLM-gen" in str(err.value)
    assert "GPU is 9.0" in str(err.value)
    assert reg.pick("attention", "xqa", "cuda").name == "trtllm-xqa"
    assert reg.pick("attention", "auto", "cuda").name != "trtllm"


def test_listing_with_a_device_shows_why(gpus: list[tuple[int, int]]) -> None:
    gpus.append(HOPPER)
    reg = load_plugins()
    table = render_table(reg, device="cuda")
    assert "attention trtllm: unsupported on cuda: TensorRT-LLM-gen attention kernels" in table
    assert "attention trtllm-xqa: unsupported" not in table
    rows = {r["name"]: r for r in to_json(reg, device="cuda")["components"]["attention"]}
    assert rows["trtllm"]["supported"] is False and "GPU is 9.0" in rows["trtllm"]["unsupported_reason"]
    assert rows["trtllm-xqa"]["supported"] is True
    assert (
        rows["trtllm-xqa"]["decode_kv_cache_dtypes"] == ["fp8_e4m3"] and rows["trtllm"]["decode_kv_cache_dtypes"] == []
    )
    assert "trtllm-xqa (alias xqa; KV cache fp8_e4m3; auto decodes fp8_e4m3 with it)" in table


def test_serve_preflight_rejects_trtllm_on_hopper_before_any_worker(
    gpus: list[tuple[int, int]], tmp_path: Path
) -> None:
    from minisgl.server.settings import PreflightError, ServeSettings, preflight

    gpus.append(HOPPER)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PreflightError, match=r"^--attn: attention backend 'trtllm' does not support device 'cuda'"):
        preflight(ServeSettings(model=str(tmp_path), attention_backend="trtllm", device="cuda"))
    assert "trtllm" in preflight(
        ServeSettings(model=str(tmp_path), attention_backend="torch,trtllm-xqa", device="cuda")
    )


def test_only_xqa_declares_an_fp8_kv_cache() -> None:
    """trtllm-xqa reads an FP8 KV cache; trtllm (TensorRT-LLM-gen, not yet run on its hardware) does not, so the
    engine refuses ``--kv-cache-dtype fp8_e4m3`` with it by name at start-up (and under auto skips it)."""
    reg = load_plugins(only=["builtin", "trtllm"])
    xqa, gen = reg.get("attention", "trtllm-xqa"), reg.get("attention", "trtllm")
    assert xqa.kv_cache_dtypes == ("fp8_e4m3",) and xqa.reads_kv_cache("fp8_e4m3") and xqa.reads_kv_cache("auto")
    assert not xqa.reads_kv_cache("fp8_e5m2")  # XQA reads e4m3 only
    assert gen.kv_cache_dtypes == () and not gen.reads_kv_cache("fp8_e4m3") and gen.reads_kv_cache("auto")
    # and '--attn auto' decodes an FP8 cache with XQA (the best-ranked backend prefills).
    assert xqa.decode_kv_cache_dtypes == ("fp8_e4m3",) and gen.decode_kv_cache_dtypes == ()
