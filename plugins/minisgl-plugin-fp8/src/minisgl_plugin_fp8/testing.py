"""Writing FP8 checkpoints as the Hugging Face and compressed-tensors tools write them, from a float model
directory, and the de-quantized weights they stand for (the tests' reference). Used by this plugin's tests.

Layouts (``LAYOUTS``):

- ``fp8-block``: ``quant_method: fp8``, ``weight_block_size: [128, 128]``: ``weight`` float8_e4m3fn and
  ``weight_scale_inv`` float32 ``[ceil(out / 128), ceil(in / 128)]`` (the last row and column blocks partial);
- ``fp8-tensor``: ``quant_method: fp8``, ``weight_block_size: null``: one float32 ``weight_scale_inv`` (shape []);
- ``autofp8``: ``quant_method: fp8`` as AutoFP8 writes it with dynamic activations (no ``weight_block_size``,
  ``ignored_layers``): one float32 ``weight_scale`` (shape []) per weight;
- ``ct-channel``: ``compressed-tensors``, ``float-quantized``: ``weight`` + ``weight_scale`` ``[out, 1]``,
  input activations dynamic per token;
- ``ct-tensor``: the same with ``strategy: tensor`` (``weight_scale`` ``[1]``).

Every other tensor (embeddings, norms, ``lm_head``, modules left unquantized) is stored in bfloat16, and
``config.json`` says ``torch_dtype: bfloat16``, as published FP8 checkpoints do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .reference import FP8, FP8_MAX

LAYOUTS = ("fp8-block", "fp8-tensor", "autofp8", "ct-channel", "ct-tensor")
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(layout: str, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` the tools write for ``layout`` (``ignore``: modules left unquantized,
    besides ``lm_head``)."""
    if layout == "autofp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head", *ignore]}
    if layout.startswith("fp8-"):
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128] if layout == "fp8-block" else None,
            "modules_to_not_convert": ["lm_head", *ignore],
        }
    strategy = layout.removeprefix("ct-")
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "ignore": ["lm_head", *ignore],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": strategy,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": None,
                    "observer_kwargs": {},
                },
                "output_activations": None,
            }
        },
    }


def quantize_weight(weight: torch.Tensor, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(checkpoint tensors by suffix, de-quantized float32 weight)`` of one ``[out, in]`` weight."""
    w = weight.float()
    out, cols = w.shape
    if layout == "fp8-block":
        rb, cb = -(-out // 128), -(-cols // 128)
        padded = torch.zeros(rb * 128, cb * 128)
        padded[:out, :cols] = w
        blocks = padded.view(rb, 128, cb, 128)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rb, cb]
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rb * 128, cb * 128)[:out, :cols]
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :cols]
        return {"weight": q.contiguous(), "weight_scale_inv": scale}, q.float() * full
    if layout in ("fp8-tensor", "autofp8", "ct-tensor"):
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        name, stored = {
            "fp8-tensor": ("weight_scale_inv", scale.reshape(())),
            "autofp8": ("weight_scale", scale.reshape(())),
            "ct-tensor": ("weight_scale", scale.reshape(1)),
        }[layout]
        return {"weight": q, name: stored.float()}, q.float() * scale
    if layout == "ct-channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [out, 1]
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"weight": q, "weight_scale": scale.float()}, q.float() * scale
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")


def write_fp8_checkpoint(
    source: str | Path, target: str | Path, layout: str, ignore: Sequence[str] = ()
) -> dict[str, torch.Tensor]:
    """Write ``source`` (a float Hugging Face directory) to ``target`` in ``layout``; return the float32 state
    dict that the checkpoint de-quantizes to (load it into the transformers model for the reference)."""
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        quantized = (
            name.endswith(".weight")
            and module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES
            and not any(entry in module for entry in ignore)
        )
        if quantized:
            parts, dequantized = quantize_weight(tensor, layout)
            stored |= {f"{module}.{suffix}": t for suffix, t in parts.items()}
            reference[name] = dequantized
        else:
            stored[name] = tensor.to(torch.bfloat16)
            reference[name] = stored[name].float()
    save_file(stored, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    config["quantization_config"] = quantization_config(layout, ignore)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    if (source / "generation_config.json").exists():
        (target / "generation_config.json").write_text((source / "generation_config.json").read_text())
    return reference
