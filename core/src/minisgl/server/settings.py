"""``minisgl serve`` settings: every field is a flag (``--max-running-requests``) and an environment variable
(``MINISGL_MAX_RUNNING_REQUESTS``); a flag wins. Nothing here imports torch, so ``--help`` and preflight are fast.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import types
import typing
from pathlib import Path, PurePath
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..config import EngineFields

ENV_PREFIX = "MINISGL_"

# Short spellings of engine flags, kept for the command line (the environment uses the long name).
FLAG_ALIASES = {"attention_backend": ["--attn"], "prefix_cache": ["--cache"], "hf_config_path": ["--model-config"]}


class ServeSettings(EngineFields, BaseSettings):
    """Everything ``minisgl serve`` and ``minisgl chat`` can be told: the engine's fields plus the server's."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=(), validate_default=True
    )

    device: str = Field("auto", description="cpu, cuda or cuda:N; auto = cuda when a GPU is visible")
    # server
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(30000, ge=0, le=65535, description="port to listen on")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer KEY' on every route but /health and /metrics"
    )
    health_timeout: float = Field(
        5.0, gt=0, description="seconds a worker may go without a heartbeat before /health reports it stopped or hung"
    )
    stall_timeout: float = Field(
        120.0, gt=0, description="seconds one engine step may run before /health reports the engine stalled"
    )
    tokenizer_workers: int | None = Field(
        None, ge=1, le=64, description="tokenizer processes; default: one per 4 CPU cores, 1 to 4"
    )
    served_model_name: str | None = Field(None, description="model name in the API; default: the model's file name")
    tool_call_parser: Literal["auto", "hermes", "llama3", "mistral"] = Field(
        "auto", description="how tool calls are read from the model's output; auto = from its chat template"
    )
    shell: bool = Field(False, description="chat in this terminal instead of serving HTTP")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")
    shutdown_timeout: float = Field(
        5.0, ge=0, description="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are ended"
    )
    # data parallelism (minisgl.server.replicas)
    dp: int = Field(
        1, ge=1, le=64, description="engine replicas behind one router (sglang-router), each with --tp devices"
    )
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = Field(
        "cache_aware", description="how the --dp router picks a replica; cache_aware = the one holding the prefix"
    )
    router_metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port of the --dp router's Prometheus metrics (on --host); default: a free one",
    )
    router_args: str | None = Field(
        None, description="more sglang-router flags for the --dp router, as one string (e.g. '--cache-threshold 0.5')"
    )
    # request limits (checked by minisgl.server.app)
    max_request_bytes: int = Field(
        2 * 2**20, ge=1024, description="largest request body in bytes; a larger one is refused (413) unread"
    )
    max_prompts: int = Field(32, ge=1, description="most prompts in one /v1/completions request")
    max_n: int = Field(16, ge=1, le=128, description="most choices (n) per prompt")

    def engine_fields(self) -> dict[str, Any]:
        """The :class:`~minisgl.config.EngineConfig` keyword arguments."""
        return {name: getattr(self, name) for name in EngineFields.model_fields}

    @property
    def model_name(self) -> str:
        """The name clients use in the ``model`` field."""
        if self.served_model_name:
            return self.served_model_name
        from ..utils.model_path import DIST_PREFIX, ModelPathError, parse_hub_id, resolve_model_path

        path = PurePath(self.model.rstrip("/"))
        hub = parse_hub_id(self.model)
        if hub is not None and not Path(self.model).expanduser().exists():
            return hub[0].split("/", 1)[1]  # Qwen/Qwen3-0.6B@main -> Qwen3-0.6B
        if self.model.startswith(DIST_PREFIX):
            try:
                path = resolve_model_path(self.model)
            except ModelPathError:
                return self.model
        return path.stem if path.suffix == ".gguf" else path.name


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _where(field: str) -> str:
    return f"{flag_name(field)} (env {ENV_PREFIX}{field.upper()})"


def _plain_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(argparse type, choices) of a field annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return str, list(typing.get_args(annotation))
    return annotation, None


def build_parser(
    prog: str = "minisgl serve", *, description: str = "", server: bool | None = None
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per settings field; unset flags stay unset (the environment applies).

    ``server``: include the server's own fields (``--host``, ``--port``, ``--api-key``, ...); ``None``: yes for
    ``minisgl serve``, no for ``minisgl chat``, which serves nothing and takes the engine's fields alone.
    """
    server = prog != "minisgl chat" if server is None else server
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        epilog=f"Every flag can also be set with an environment variable: {ENV_PREFIX}<FLAG NAME> "
        f"(e.g. {ENV_PREFIX}MAX_RUNNING_REQUESTS=32). A flag wins over the environment.",
    )
    engine_group = parser.add_argument_group("model and engine")
    server_group = parser.add_argument_group("server") if server else None
    for name, info in ServeSettings.model_fields.items():
        group = engine_group if name in EngineFields.model_fields else server_group
        if group is None:
            continue
        default = "required; " if info.is_required() else "" if info.default is None else f"default: {info.default}; "
        help_text = f"{info.description} ({default}env {ENV_PREFIX}{name.upper()})"
        flags = [flag_name(name), *FLAG_ALIASES.get(name, [])]
        kind, choices = _plain_type(info.annotation)
        if kind is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            named = str(extra.get("metavar") or name.split("_")[-1].upper())
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else named
            group.add_argument(*flags, dest=name, type=kind, choices=choices, metavar=metavar, help=help_text)
    return parser


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the flag and its environment variable."""


def settings_from_args(values: dict[str, Any]) -> ServeSettings:
    """Flag values (unset flags absent) plus ``MINISGL_*`` environment variables; SettingsError names each bad one."""
    try:
        return ServeSettings(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            where = _where(field) if field in ServeSettings.model_fields else field
            missing = err["type"] == "missing"
            problems.append(f"{where} is required" if missing else f"{where}: {err['msg']}, got {err.get('input')!r}")
        raise SettingsError("; ".join(problems)) from None


def parse_settings(argv: list[str], *, prog: str = "minisgl serve", description: str = "") -> ServeSettings:
    return settings_from_args(vars(build_parser(prog, description=description).parse_args(argv)))


class PreflightError(ValueError):
    """Settings that were well formed but cannot work (unknown backend, missing model, ...)."""


def preflight(settings: ServeSettings) -> list[str]:
    """Check the settings without loading anything heavy; return the active plugin names for the workers."""
    from ..config import EngineConfig
    from ..core import ValidationError
    from ..plugins import (
        AttentionBackendSpec,
        PluginError,
        UnknownComponentError,
        choose_quantization,
        load_plugins,
        quantization_config_of,
        read_model_config,
    )

    device = settings.device
    try:
        EngineConfig(**{**settings.engine_fields(), "device": "cpu" if device == "auto" else device})
    except ValidationError as exc:
        raise PreflightError(f"{_where(exc.field)}: {exc.message}") from None
    from ..utils.model_path import ModelPathError, check_model, parse_hub_id, resolve_model_path

    # A Hub id is downloaded here, once, before the workers start (they then find it cached).
    model_dir: Path | None = None
    if not (settings.load_format == "dummy" and settings.hf_config_path) or parse_hub_id(settings.model):
        try:
            model_dir = resolve_model_path(settings.model)
            check_model(model_dir)
        except ModelPathError as exc:
            raise PreflightError(f"--model: {exc}") from None
    try:
        registry = load_plugins(paths=settings.plugin_paths)
    except PluginError as exc:
        raise PreflightError(f"--plugin-paths: {exc}") from None
    # A component named for a device it cannot run on fails here, with its reason, before any worker starts.
    target = device.split(":")[0] if device != "auto" else likely_device()
    checks = [("attention", "--attn", n.strip()) for n in settings.attention_backend.split(",")]
    checks += [("prefix_cache", "--cache", settings.prefix_cache), ("kv_pool", "--kv-pool", settings.kv_pool)]
    checks += [("moe", "--moe-backend", settings.moe_backend), ("kernels", "--kernels", settings.kernels)]
    # Structured output is optional: "auto" with no grammar backend installed only refuses grammar requests.
    if settings.grammar_backend != "auto":
        checks.append(("grammar", "--grammar-backend", settings.grammar_backend))
    for kind, flag, name in checks:
        if not name:
            raise PreflightError(f"--attn: expected NAME or PREFILL,DECODE, got '{settings.attention_backend}'")
        try:
            if target is not None:
                registry.pick(kind, name, target)  # type: ignore[arg-type]
            elif name != "auto":
                registry.get(kind, name)  # type: ignore[arg-type]
        except UnknownComponentError as exc:
            raise PreflightError(f"{flag}: {exc}") from None
    # A checkpoint quantized in a way no installed plugin reads is refused here, naming its quant_method, and so
    # is what the chosen method says it cannot load (a setting of the checkpoint's config, a model kind).
    config_file = settings.hf_config_path or model_dir
    model_config = (read_model_config(config_file) if config_file is not None else None) or {}
    quant_config = quantization_config_of(model_config)
    try:
        choice = choose_quantization(registry, settings.quantization, quant_config, target or "cpu")
    except UnknownComponentError as exc:
        raise PreflightError(f"--quantization: {exc}") from None
    try:
        choice.spec.check(choice.config, model_config)
    except ValueError as exc:
        raise PreflightError(f"--quantization: {choice.spec.label}: {exc}") from None
    # A named backend that cannot read the KV cache dtype fails here too (the engine would refuse it the same way).
    for name in (n.strip() for n in settings.attention_backend.split(",")):
        spec = registry.get("attention", name) if name != "auto" else None
        kv = settings.kv_cache_dtype
        if isinstance(spec, AttentionBackendSpec) and not spec.reads_kv_cache(kv):
            readers = [s.name for s in registry.specs("attention") if isinstance(s, AttentionBackendSpec)
                       and s.reads_kv_cache(kv)]  # fmt: skip
            raise PreflightError(
                f"--kv-cache-dtype: {spec.label} cannot read a {kv} KV cache; installed backends that can: "
                f"{', '.join(readers) or 'none'} (use one with --attn, or --kv-cache-dtype auto)"
            )
    return registry.active_plugin_names()


def likely_device() -> str | None:
    """The device ``--device auto`` will get ("cuda" or "cpu"), told without importing torch; None if unsure.

    torch picks CUDA when it is a CUDA build (written in ``torch/version.py``) and a GPU is visible (asked of the
    driver through NVML, see :mod:`minisgl.plugins.devices`).
    """
    from ..plugins import devices

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        version = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    match = re.search(r"^cuda\b.*=\s*(.+)$", version, re.MULTILINE)
    if match is None:
        return None
    if match.group(1).strip() == "None":
        return "cpu"
    caps = devices.nvml_capabilities()
    if caps is None:
        return None  # no driver library to ask: leave the device to the worker
    return "cuda" if devices.only_visible(caps, os.environ.get("CUDA_VISIBLE_DEVICES")) else "cpu"
