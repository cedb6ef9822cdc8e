"""The hardware floor of the offline workload: ``minisgl bench roofline``.

How fast could any engine run the protocol's offline workload on a GPU, given only
the model's shape, the bytes per weight and per KV element, and the GPU's peak
rates? This module walks the work in the order the engine does it when all 256
requests arrive at once (prefill in chunks of ``chunk`` tokens, then one decode
step per output position while requests remain) and gives each step the larger of

* its compute at peak rate: the linear layers' ``2 * params * tokens`` FLOPs at the
  weights' tensor-core rate (FP8 weights run at the FP8 rate), attention's
  ``4 * heads * head_dim`` FLOPs per attended key and the 16-bit LM head at the
  bf16 rate;
* its memory traffic at peak bandwidth: every weight read once per step, every
  cached key and value a query attends to read once, the step's new KV written.

Activations, norms, sampling, launch gaps and imperfect overlap of compute and
memory inside a step are left out, so a real engine cannot reach the floor; the
ratio of a measured throughput to it says how much is left and where (the
breakdown says whether prefill or decode, compute or memory dominates).

The *kernel floor* is the same walk for an engine that runs a step's GEMMs and
its attention as separate kernels, one after the other (every engine measured
here): each step then costs its GEMMs' bound (compute or weight traffic) plus
its attention's (compute or KV traffic), so that a compute-bound GEMM cannot
hide a memory-bound attention.

Dense decoders only (Llama, Qwen3, Mistral shapes); a mixture-of-experts config is
refused. The default rates are the protocol's floor figures for one H200:
790 TFLOP/s (bf16 tensor cores; twice that for FP8) and 4.3 TB/s. ``--gpu h100``
(and ``minisgl bench offline`` on an H100) uses an H100 SXM's: the same tensor
cores (the H200 is the same GH100 chip with more and faster memory) and 3.0 TB/s,
the H200's measured-to-peak copy ratio (4.3 of 4.8 TB/s) applied to the H100's
3.35 TB/s peak.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .workloads import CONFIG_DIR, Workload, gpu_workload

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
FP8_QUANT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs of a dense decoder's ``config.json``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        for key in MOE_KEYS:
            if config.get(key):
                raise ValueError(f"roofline models dense decoders only; this config has {key}={config[key]}")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
            )
        except KeyError as exc:
            raise ValueError(f"config.json has no {exc.args[0]!r}: not a decoder config roofline can read") from exc

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o, gate, up and down projections of one layer."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate

    @property
    def linear_params(self) -> int:
        return self.layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_elements_per_token(self) -> int:
        """Keys and values of one token, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Hardware:
    """Peak rates: dense tensor-core FLOP/s for bf16 and FP8 inputs, and memory bandwidth (bytes/s)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    bandwidth: float


H200 = Hardware("H200 (protocol floor: 790 TFLOP/s bf16, 1580 FP8, 4.3 TB/s)", 790e12, 1580e12, 4.3e12)
H100 = Hardware(
    "H100 SXM (790 TFLOP/s bf16, 1580 FP8, 3.0 TB/s: the H200's rates at the H100's bandwidth)", 790e12, 1580e12, 3.0e12
)
GPUS: dict[str, Hardware] = {"h200": H200, "h100": H100}


def hardware_for(gpu_name: str | None) -> Hardware | None:
    """The preset for a GPU named as ``torch.cuda.get_device_name`` names it: the SXM H100 or H200, whose rates
    the presets are; ``None`` for any other GPU (a PCIe or NVL card has other bandwidth or clocks)."""
    name = (gpu_name or "").upper()
    if "PCIE" in name or "NVL" in name:
        return None
    return next((hw for key, hw in GPUS.items() if key.upper() in name), None)


@dataclass(frozen=True)
class Precision:
    """Bytes per linear-layer weight and per KV element (the LM head stays 16-bit)."""

    weight_bytes: int = 2
    kv_bytes: int = 2

    @property
    def label(self) -> str:
        w = "FP8" if self.weight_bytes == 1 else "bf16"
        kv = "FP8" if self.kv_bytes == 1 else "bf16"
        return f"{w} weights, {kv} KV"


@dataclass
class PhaseCost:
    """Sums over the steps of one phase."""

    steps: int = 0
    seconds: float = 0.0
    compute_bound_steps: int = 0
    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    compute_seconds: float = 0.0  # what the steps would take at peak compute alone
    memory_seconds: float = 0.0  # ... at peak bandwidth alone
    kernel_seconds: float = 0.0  # GEMMs and attention as separate kernels, each at its own bound


@dataclass(frozen=True)
class Floor:
    """The workload's floor and where it comes from."""

    hardware: str
    precision: str
    output_tokens: int
    prefill: PhaseCost
    decode: PhaseCost

    @property
    def seconds(self) -> float:
        return self.prefill.seconds + self.decode.seconds

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def kernel_seconds(self) -> float:
        return self.prefill.kernel_seconds + self.decode.kernel_seconds

    @property
    def kernel_tok_s(self) -> float:
        return self.output_tokens / self.kernel_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware,
            "precision": self.precision,
            "seconds": self.seconds,
            "tok_s": self.tok_s,
            "kernel_seconds": self.kernel_seconds,
            "kernel_tok_s": self.kernel_tok_s,
            "output_tokens": self.output_tokens,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
        }


class _Costing:
    """Prices steps for one model shape, precision and GPU, adding each into a :class:`PhaseCost`."""

    def __init__(self, shape: ModelShape, precision: Precision, hw: Hardware):
        self.shape, self.precision, self.hw = shape, precision, hw
        self.linear_rate = hw.fp8_flops if precision.weight_bytes == 1 else hw.bf16_flops
        self.weights = shape.linear_params * precision.weight_bytes + shape.lm_head_params * 2
        self.kv_token = shape.kv_elements_per_token() * precision.kv_bytes

    def step(self, phase: PhaseCost, new_tokens: int, attended: int, kv_read: int, sampled: int) -> None:
        """One step: ``new_tokens`` through the layers, ``attended`` (query, key) pairs per layer and head,
        ``kv_read`` cached tokens read, ``sampled`` rows through the LM head."""
        s, hw = self.shape, self.hw
        linear = 2.0 * s.linear_params * new_tokens
        head = 2.0 * s.lm_head_params * sampled
        attention = 4.0 * s.layers * s.heads * s.head_dim * attended
        kv_bytes = float(kv_read + new_tokens) * self.kv_token
        gemm_compute = linear / self.linear_rate + head / hw.bf16_flops
        attn_compute = attention / hw.bf16_flops
        gemm_memory, attn_memory = self.weights / hw.bandwidth, kv_bytes / hw.bandwidth
        compute, memory = gemm_compute + attn_compute, gemm_memory + attn_memory
        phase.steps += 1
        phase.seconds += max(compute, memory)
        phase.kernel_seconds += max(gemm_compute, gemm_memory) + max(attn_compute, attn_memory)
        phase.compute_bound_steps += compute >= memory
        phase.flops += linear + head + attention
        phase.weight_bytes += self.weights
        phase.kv_bytes += kv_bytes
        phase.compute_seconds += compute
        phase.memory_seconds += memory


def floor(
    shape: ModelShape,
    work: Workload,
    precision: Precision = Precision(),
    hw: Hardware = H200,
    chunk: int = 8192,
) -> Floor:
    """The floor of ``work`` when every request is admitted at once (the offline protocol's case)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    cost = _Costing(shape, precision, hw)
    prompts = [len(p) for p in work.prompts]
    prefill, decode = PhaseCost(), PhaseCost()
    # Prefill: the prompts in order, cut into chunks of `chunk` tokens; a request split across
    # chunks reads its earlier chunks' KV from the cache.
    req, done = 0, 0  # the request being prefilled and how many of its tokens are
    while req < len(prompts):
        room, attended, kv_read, sampled, new = chunk, 0, 0, 0, 0
        while room and req < len(prompts):
            take = min(room, prompts[req] - done)
            attended += take * done + take * (take + 1) // 2  # each position attends to itself and all before
            kv_read += done
            new += take
            room -= take
            done += take
            if done == prompts[req]:
                sampled += 1  # the first output token comes from the prefill step
                req, done = req + 1, 0
        cost.step(prefill, new, attended, kv_read, sampled)
    # Decode: step k feeds each request's k-th output token while it still has tokens to produce.
    for k in range(1, max(work.output_lens, default=0)):
        active = [p + k for p, n in zip(prompts, work.output_lens, strict=True) if n > k]
        cached = sum(active) - len(active)
        cost.step(decode, len(active), cached + len(active), cached, len(active))
    return Floor(hw.name, precision.label, work.output_tokens, prefill, decode)


def precision_of(config: dict[str, Any], quantization: str | None, kv_cache_dtype: str | None) -> Precision:
    """Bytes per weight and KV element for a run: FP8 weights with ``--quantization fp8`` or an FP8
    checkpoint's ``quantization_config``, an FP8 cache with ``--kv-cache-dtype fp8*``."""
    qc = config.get("quantization_config") or {}
    fp8_weights = quantization == "fp8" or (quantization is None and qc.get("quant_method") in FP8_QUANT_METHODS)
    fp8_kv = bool(kv_cache_dtype) and str(kv_cache_dtype).startswith("fp8")
    return Precision(weight_bytes=1 if fp8_weights else 2, kv_bytes=1 if fp8_kv else 2)


def table(result: Floor, measured: float | None = None) -> str:
    """The floor as printed: each phase's time and what bounds it."""
    lines = [f"floor of the offline workload, {result.precision}, {result.hardware}"]
    lines.append(
        f"{'phase':<8} {'steps':>6} {'seconds':>8} {'kernel s':>9} {'compute s':>10} {'memory s':>9} "
        f"{'compute-bound':>14} {'TFLOP':>8} {'weights TB':>11} {'KV TB':>7}"
    )
    for name, p in (("prefill", result.prefill), ("decode", result.decode)):
        lines.append(
            f"{name:<8} {p.steps:>6} {p.seconds:>8.2f} {p.kernel_seconds:>9.2f} {p.compute_seconds:>10.2f} "
            f"{p.memory_seconds:>9.2f} {p.compute_bound_steps:>14} {p.flops / 1e12:>8.0f} "
            f"{p.weight_bytes / 1e12:>11.2f} {p.kv_bytes / 1e12:>7.2f}"
        )
    lines.append(f"floor         {result.seconds:.2f} s: {result.tok_s:,.0f} output tok/s at most")
    lines.append(
        f"kernel floor  {result.kernel_seconds:.2f} s: {result.kernel_tok_s:,.0f} output tok/s at most "
        "(GEMMs, then attention)"
    )
    if measured:
        lines.append(
            f"measured {measured:,.0f} tok/s: {measured / result.tok_s:.0%} of the floor's rate, "
            f"{measured / result.kernel_tok_s:.0%} of the kernel floor's"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisgl bench roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default=None, help="a config.json (default: the Qwen3-0.6B shape)")
    p.add_argument("--quantization", default=None, help="fp8: FP8 linear weights (default: the config's)")
    p.add_argument("--kv-cache-dtype", default=None, help="fp8_e4m3: an FP8 KV cache (default: 16-bit)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="whose peak rates (default: h200)")
    p.add_argument("--tflops", type=float, default=None, help="bf16 tensor-core TFLOP/s (default: the --gpu's)")
    p.add_argument("--fp8-tflops", type=float, default=None, help="FP8 tensor-core TFLOP/s (default: twice --tflops)")
    p.add_argument("--tb-s", type=float, default=None, help="memory bandwidth, TB/s (default: the --gpu's)")
    p.add_argument("--measured", type=float, default=None, help="a measured tok/s to set against the floor")
    p.add_argument("--output", default=None, help="also write the floor as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = Path(args.model_config) if args.model_config else CONFIG_DIR / "qwen3-0.6b.json"
    config = json.loads(path.read_text())
    base = hw = GPUS[args.gpu]
    if (args.tflops, args.fp8_tflops, args.tb_s) != (None, None, None):
        tflops = args.tflops or base.bf16_flops / 1e12
        fp8 = args.fp8_tflops or 2 * tflops
        tb_s = args.tb_s or base.bandwidth / 1e12
        hw = Hardware(f"{tflops:g} TFLOP/s bf16, {fp8:g} FP8, {tb_s:g} TB/s", tflops * 1e12, fp8 * 1e12, tb_s * 1e12)
    result = floor(
        ModelShape.from_config(config),
        gpu_workload(),
        precision_of(config, args.quantization, args.kv_cache_dtype),
        hw,
        args.chunked_prefill_size,
    )
    print(table(result, args.measured))
    if args.output:
        record = {"benchmark": "roofline", "model_config": str(path), **result.to_dict()}
        if args.measured:
            record["measured_tok_s"] = args.measured
            record["ratio_to_floor"] = args.measured / result.tok_s
            record["ratio_to_kernel_floor"] = args.measured / result.kernel_tok_s
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0
