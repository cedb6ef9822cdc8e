"""The GPU query behind support checks: NVML order, CUDA_VISIBLE_DEVICES, and the torch fallback."""

from __future__ import annotations

import ctypes

import pytest

from minisgl.plugins import devices

HOPPER, B200, B300, A100 = (9, 0), (10, 0), (10, 3), (8, 0)


def test_cuda_visible_devices_selects_nvml_entries() -> None:
    caps = [HOPPER, B200, A100]
    assert devices.only_visible(caps, None) == caps
    assert devices.only_visible(caps, "") == []
    assert devices.only_visible(caps, "2,0") == [A100, HOPPER]
    assert devices.only_visible(caps, "1,7,0") == [B200]  # CUDA stops at the first invalid index
    assert devices.only_visible(caps, "-1") == []
    assert devices.only_visible(caps, "GPU-5e6f7a") == caps  # UUIDs are not resolved: all kept


def test_nvml_answer_is_filtered_by_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "nvml_capabilities", lambda: [HOPPER, B300])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.cuda_capabilities() == [B300]


def test_without_nvml_the_query_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert devices.nvml_capabilities() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [HOPPER, B300][i])
    assert devices.cuda_capabilities() == [HOPPER, B300]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.cuda_capabilities() == []
