"""Reading a checkpoint's ``quantization_config`` into an :class:`FP8Scheme` (no torch): the Hugging Face ``fp8``
layout (``weight`` float8_e4m3fn + ``weight_scale_inv``, block-wise or per-tensor) and ``compressed-tensors`` FP8
W8A8 (``weight`` + ``weight_scale`` per channel or per tensor, activations quantized per token at run time).
Any setting these layouts could hold but this plugin does not run is refused by name."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

HELP = "see the minisgl-plugin-fp8 README for the layouts it reads"


class FP8ConfigError(ValueError):
    """A quantization_config setting this plugin does not support."""


@dataclass(frozen=True)
class FP8Scheme:
    """How the weights of quantized layers are stored and how activations are quantized.

    ``weight``: ``block`` (one scale per ``block`` = (rows, cols) tile), ``channel`` (one per output row) or
    ``tensor`` (one per checkpoint tensor); ``scale_name``: the checkpoint's scale tensor suffix; activations are
    always quantized at run time: per token (``channel``/``tensor``) or per token and ``block[1]`` columns
    (``block``). ``layout`` says where the scheme came from (``online``: quantized at load from a bf16 checkpoint).
    ``scale_aliases``: other suffixes the same scale is read from (per-tensor ``fp8`` checkpoints name it
    ``weight_scale_inv`` or, as AutoFP8 writes them, ``weight_scale``).
    """

    layout: Literal["fp8", "compressed-tensors", "online"]
    weight: Literal["block", "channel", "tensor"]
    scale_name: str
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) the checkpoint left unquantized
    scale_aliases: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``) is left unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif self.layout == "fp8":
                if entry in module:  # transformers matches modules_to_not_convert as substrings
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


ONLINE = FP8Scheme("online", "channel", "weight_scale")

_HF_KEYS = {
    "quant_method",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
    "modules_to_convert",
    "dequantize",
    "scale_fmt",
    "fmt",
    "expert_dtype",
}
_CT_IGNORED_KEYS = {"global_compression_ratio", "quantization_status", "version", "provider", "kv_cache_scheme"}
_CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "sparsity_config", "transform_config"}


def _refuse(setting: str, value: Any, supported: str) -> FP8ConfigError:
    return FP8ConfigError(f"quantization_config {setting} {value!r} is not supported ({supported}); {HELP}")


def parse_config(config: dict[str, Any] | None) -> FP8Scheme:
    """The scheme of ``config`` (a checkpoint's quantization_config; None: quantize a bf16 checkpoint at load)."""
    if config is None:
        return ONLINE
    method = config.get("quant_method")
    if method == "fp8":
        return _parse_hf(config)
    if method == "compressed-tensors":
        return _parse_compressed(config)
    raise _refuse("quant_method", method, "reads 'fp8' and 'compressed-tensors'")


def _names(value: Any, setting: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise _refuse(setting, value, "expected a list of module names")
    return tuple(value)


def _parse_hf(config: dict[str, Any]) -> FP8Scheme:
    if unknown := sorted(set(config) - _HF_KEYS):
        raise _refuse(unknown[0], config[unknown[0]], f"the fp8 layout's settings are {', '.join(sorted(_HF_KEYS))}")
    if (scheme := str(config.get("activation_scheme", "dynamic")).lower()) != "dynamic":
        raise _refuse("activation_scheme", scheme, "only 'dynamic' activation scales")
    if config.get("modules_to_convert"):
        raise _refuse("modules_to_convert", config["modules_to_convert"], "only linear layers are quantized")
    if (fmt := config.get("scale_fmt", "float")) != "float":
        raise _refuse("scale_fmt", fmt, "only 'float' (float32) scales")
    if (fmt := config.get("fmt", "e4m3")) != "e4m3":
        raise _refuse("fmt", fmt, "only 'e4m3' (float8_e4m3fn) weights")
    if (experts := config.get("expert_dtype", "fp8")) != "fp8":
        raise _refuse("expert_dtype", experts, "only 'fp8'")
    ignore = _names(config.get("modules_to_not_convert") or config.get("ignored_layers"), "modules_to_not_convert")
    block = config.get("weight_block_size")
    if block is None:
        return FP8Scheme("fp8", "tensor", "weight_scale_inv", ignore=ignore, scale_aliases=("weight_scale",))
    if not (isinstance(block, Sequence) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "two positive integers, e.g. [128, 128]")
    return FP8Scheme("fp8", "block", "weight_scale_inv", (int(block[0]), int(block[1])), ignore)


def _args(group: str, what: str, args: Any) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise _refuse(f"config_groups.{group}.{what}", args, "expected FP8 quantization arguments")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        value = f"{args.get('type')} {args.get('num_bits')}-bit"
        raise _refuse(f"config_groups.{group}.{what}", value, "only 8-bit float (FP8)")
    if args.get("symmetric", True) is not True:
        raise _refuse(f"config_groups.{group}.{what}.symmetric", args.get("symmetric"), "only symmetric scales")
    for key in ("actorder", "group_size"):
        if args.get(key) is not None and not (key == "group_size" and what == "input_activations"):
            raise _refuse(f"config_groups.{group}.{what}.{key}", args[key], "not used by FP8 channel/tensor scales")
    return args


def _parse_compressed(config: dict[str, Any]) -> FP8Scheme:
    if unknown := sorted(set(config) - _CT_KEYS - _CT_IGNORED_KEYS):
        raise _refuse(unknown[0], config[unknown[0]], f"the settings read are {', '.join(sorted(_CT_KEYS))}")
    if (fmt := config.get("format")) != "float-quantized":
        raise _refuse("format", fmt, "only 'float-quantized' (float8_e4m3fn weights with scales)")
    if config.get("sparsity_config"):
        raise _refuse("sparsity_config", config["sparsity_config"], "no sparse (2:4) weights")
    if config.get("transform_config"):
        raise _refuse("transform_config", config["transform_config"], "no transforms")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "expected one FP8 group")
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"config_groups.{name}", group, "expected a group of quantization arguments")
        if (targets := group.get("targets")) != ["Linear"]:
            raise _refuse(f"config_groups.{name}.targets", targets, "only ['Linear']")
        if (fmt := group.get("format")) not in (None, "float-quantized"):
            raise _refuse(f"config_groups.{name}.format", fmt, "only 'float-quantized'")
        if group.get("output_activations") is not None:
            raise _refuse(f"config_groups.{name}.output_activations", group["output_activations"], "none")
        weights = _args(name, "weights", group.get("weights"))
        if (strategy := weights.get("strategy")) not in ("channel", "tensor"):
            raise _refuse(f"config_groups.{name}.weights.strategy", strategy, "'channel' or 'tensor'")
        if weights.get("dynamic", False) is not False:
            raise _refuse(f"config_groups.{name}.weights.dynamic", weights["dynamic"], "static weight scales")
        acts = group.get("input_activations")
        if acts is None:
            raise _refuse(f"config_groups.{name}.input_activations", None, "W8A8 only: FP8 weight-only is not run")
        acts = _args(name, "input_activations", acts)
        if acts.get("strategy") != "token" or acts.get("dynamic") is not True:
            value = f"strategy {acts.get('strategy')!r}, dynamic {acts.get('dynamic')!r}"
            raise _refuse(f"config_groups.{name}.input_activations", value, "dynamic per-token scales only")
        schemes.add(strategy)
    if len(schemes) > 1:
        raise _refuse("config_groups", sorted(schemes), "one weight strategy for every group")
    return FP8Scheme("compressed-tensors", schemes.pop(), "weight_scale", ignore=_names(config.get("ignore"), "ignore"))


def check_config(config: dict[str, Any] | None, model_config: dict[str, Any]) -> None:
    """What the server asks before any worker starts (no torch): ``config`` parses (:func:`parse_config`);
    :class:`FP8ConfigError` naming the setting otherwise. Dense and mixture-of-experts models load alike."""
    parse_config(config)
