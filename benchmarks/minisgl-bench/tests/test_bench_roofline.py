"""``minisgl bench roofline``: the offline workload's floor, checked by hand on a tiny case and
against the protocol's own estimate for the Qwen3-0.6B shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from minisgl_bench.offline import _against_floor
from minisgl_bench.roofline import H100, H200, Hardware, ModelShape, Precision, floor, hardware_for, main, precision_of
from minisgl_bench.workloads import CONFIG_DIR, Workload, gpu_workload

TINY = {
    "num_hidden_layers": 1,
    "hidden_size": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "intermediate_size": 4,
    "vocab_size": 8,
}


def _config(name: str) -> dict:
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


def test_shape_counts_the_linear_parameters() -> None:
    shape = ModelShape.from_config(TINY)
    # q, k, v: 2 x (1 + 2) x 2; o: 1 x 2 x 2; gate, up, down: 3 x 2 x 4
    assert shape.linear_params_per_layer == 12 + 4 + 24
    assert shape.lm_head_params == 16 and shape.kv_elements_per_token() == 4
    qwen8b = ModelShape.from_config(_config("qwen3-8b"))
    assert 6.9e9 < qwen8b.linear_params < 7.0e9  # Qwen3-8B: 8.2 B parameters, 1.2 B of them embeddings and head


def test_floor_of_a_tiny_workload_by_hand() -> None:
    """One request, 3 prompt tokens and 3 output tokens, prefilled in chunks of 2."""
    shape = ModelShape.from_config(TINY)
    hw = Hardware("test", bf16_flops=100.0, fp8_flops=200.0, bandwidth=10.0)
    result = floor(shape, Workload([[0, 0, 0]], [3]), Precision(), hw, chunk=2)
    pre, dec = result.prefill, result.decode
    assert (pre.steps, dec.steps) == (2, 2)
    # Prefill: chunk 1 = positions 0-1 (1 + 2 attended pairs), chunk 2 = position 2 (3 pairs, 2 cached
    # tokens read, the first output token sampled).
    linear = 2 * 40
    assert pre.flops == linear * 3 + 4 * 2 * (3 + 3) + 2 * 16 * 1
    # Decode: positions 3 and 4 attend to 4 and 5 keys, having 3 and 4 cached; one row sampled each.
    assert dec.flops == 2 * linear + 4 * 2 * (4 + 5) + 2 * 2 * 16
    weights = 40 * 2 + 16 * 2
    assert pre.weight_bytes == dec.weight_bytes == 2 * weights
    assert pre.kv_bytes == (0 + 2 + 2 + 1) * 4 * 2 and dec.kv_bytes == (3 + 4 + 2) * 4 * 2

    def step(flops: float, kv_tokens: int) -> float:
        return max(flops / 100.0, (weights + kv_tokens * 8) / 10.0)

    expected_decode = step(linear + 4 * 2 * 4 + 32, 4) + step(linear + 4 * 2 * 5 + 32, 5)
    assert dec.seconds == pytest.approx(expected_decode)
    # Kernel floor: the GEMMs' bound plus attention's, per step.
    gemm = max((linear + 32) / 100.0, weights / 10.0)
    kernels = gemm + max(4 * 2 * 4 / 100.0, 4 * 8 / 10.0) + gemm + max(4 * 2 * 5 / 100.0, 5 * 8 / 10.0)
    assert dec.kernel_seconds == pytest.approx(kernels)
    assert result.tok_s == pytest.approx(3 / result.seconds)


def test_qwen3_06b_floor_matches_the_protocol_estimate() -> None:
    """The protocol: ~121 M token reads of 112 KiB (13.9 TB) and 1.2 TB of weights, about 3.5 s."""
    result = floor(ModelShape.from_config(_config("qwen3-0.6b")), gpu_workload())
    assert result.decode.steps == 1023 and result.prefill.steps == 18  # 142,827 prompt tokens / 8,192
    assert result.decode.kv_bytes == pytest.approx(13.9e12, rel=0.01)
    assert result.decode.weight_bytes == pytest.approx(1.22e12, rel=0.02)
    assert 3.4 < result.seconds < 3.8 and result.decode.compute_bound_steps == 0


def test_fp8_halves_the_bytes_it_applies_to() -> None:
    shape, work = ModelShape.from_config(_config("llama-3.1-8b")), gpu_workload()
    bf16 = floor(shape, work)
    w8 = floor(shape, work, Precision(weight_bytes=1))
    kv8 = floor(shape, work, Precision(weight_bytes=1, kv_bytes=1))
    head = shape.lm_head_params * 2 * bf16.decode.steps  # the LM head stays 16-bit
    assert w8.decode.weight_bytes - head == pytest.approx((bf16.decode.weight_bytes - head) / 2)
    assert kv8.decode.kv_bytes == pytest.approx(bf16.decode.kv_bytes / 2)
    assert w8.prefill.seconds < bf16.prefill.seconds  # prefill is compute-bound: FP8 runs at twice the rate
    assert bf16.tok_s < w8.tok_s < kv8.tok_s
    for r in (bf16, w8, kv8):  # separate kernels cannot beat the floor; at batch 256 the GEMMs are compute-bound
        assert r.seconds < r.kernel_seconds


def test_precision_of_a_run() -> None:
    plain = _config("qwen3-8b")
    assert precision_of(plain, None, None) == Precision(2, 2)
    assert precision_of(plain, "fp8", "fp8_e4m3") == Precision(1, 1)
    checkpoint = {**plain, "quantization_config": {"quant_method": "fp8"}}
    assert precision_of(checkpoint, None, "auto") == Precision(1, 2)
    assert precision_of(checkpoint, "none", None) == Precision(2, 2)


@pytest.mark.parametrize(
    ("config", "words"),
    [({**TINY, "num_experts": 8}, "dense decoders only"), ({"hidden_size": 2}, "num_attention_heads")],
)
def test_configs_it_cannot_read_are_refused_by_name(config: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ModelShape.from_config(config)


def test_cli_prints_and_writes_the_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "floor.json"
    cfg = str(CONFIG_DIR / "qwen3-8b.json")
    assert main(["--model-config", cfg, "--quantization", "fp8", "--measured", "11000", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FP8 weights, bf16 KV" in text and "of the kernel floor's" in text
    record = json.loads(out.read_text())
    assert record["hardware"] == H200.name and record["ratio_to_floor"] == pytest.approx(11000 / record["tok_s"])
    assert record["ratio_to_kernel_floor"] == pytest.approx(11000 / record["kernel_tok_s"])
    main(["--model-config", cfg, "--tb-s", "8.6", "--output", str(out)])
    faster = json.loads(out.read_text())
    assert "8.6 TB/s" in faster["hardware"] and faster["decode"]["memory_seconds"] < record["decode"]["memory_seconds"]


def _args(**kw: object) -> argparse.Namespace:
    base = {"load_format": "dummy", "model_config": None, "model": "qwen3-0.6b", "chunked_prefill_size": 8192}
    return argparse.Namespace(**{**base, "quantization": None, "kv_cache_dtype": None, **kw})


def test_offline_sets_a_run_against_its_own_floor(capsys: pytest.CaptureFixture[str]) -> None:
    record: dict = {"machine": {"gpu": "NVIDIA H200"}}
    _against_floor(_args(), record, gpu_workload(), 25_000.0)
    assert record["ratio_to_minisglang_21100"] == pytest.approx(25_000 / 21_100)
    assert record["ratio_to_floor"] == pytest.approx(25_000 / record["floor"]["tok_s"])
    # At another shape the 0.6B reference does not apply; the floor follows the shape and precision.
    eight: dict = {"machine": {"gpu": "NVIDIA H200"}}
    _against_floor(
        _args(model_config=str(CONFIG_DIR / "qwen3-8b.json"), quantization="fp8"), eight, gpu_workload(), 11_000.0
    )
    assert "ratio_to_minisglang_21100" not in eight and eight["floor"]["precision"] == "FP8 weights, bf16 KV"
    assert eight["floor"]["tok_s"] < record["floor"]["tok_s"]
    assert "of the floor's rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", H100),
        ("NVIDIA H200", H200),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-80GB", None),
        (None, None),
    ],
)
def test_the_floor_follows_the_gpu_the_run_had(gpu: str | None, expected: Hardware | None) -> None:
    assert hardware_for(gpu) is expected


def test_a_gpu_with_no_preset_gets_the_h200_floor_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    record: dict = {"machine": {"gpu": "NVIDIA A100-SXM4-80GB"}}
    _against_floor(_args(), record, gpu_workload(), 19_000.0)
    assert record["floor"]["hardware"] == H200.name and "ratio_to_minisglang_21100" not in record
    assert "A100-SXM4-80GB" in record["floor_note"] and record["floor_note"] in capsys.readouterr().out


def test_an_h100_run_gets_the_h100_floor_and_no_h200_reference(capsys: pytest.CaptureFixture[str]) -> None:
    h100: dict = {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}}
    h200: dict = {"machine": {"gpu": "NVIDIA H200"}}
    _against_floor(_args(), h100, gpu_workload(), 19_000.0)
    _against_floor(_args(), h200, gpu_workload(), 19_000.0)
    assert h100["floor"]["hardware"] == H100.name and "ratio_to_minisglang_21100" not in h100
    # Less bandwidth, same tensor cores: a slower floor for the memory-bound decode, the same prefill compute.
    assert h100["floor"]["tok_s"] < h200["floor"]["tok_s"]
    assert h100["floor"]["prefill"]["compute_seconds"] == pytest.approx(h200["floor"]["prefill"]["compute_seconds"])
    assert "is an H200's" in capsys.readouterr().out


def test_cli_takes_the_h100_rates(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    assert main(["--gpu", "h100", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["hardware"] == H100.name
    main(["--gpu", "h100", "--tb-s", "3.35", "--output", str(out)])
    assert "3.35 TB/s" in json.loads(out.read_text())["hardware"]
