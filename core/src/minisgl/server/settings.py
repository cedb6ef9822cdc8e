"""``minisgl serve`` settings: one pydantic-settings model, flags generated from it.

Every field is a command-line flag (``--max-running-requests``) and an
environment variable (``MINISGL_MAX_RUNNING_REQUESTS``); a flag wins over the
environment. Nothing here imports torch, so ``minisgl serve --help`` is fast.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "MINISGL_"

# Settings fields that are EngineConfig fields under another name.
ENGINE_FIELD_NAMES = {"attn": "attention_backend", "cache": "prefix_cache", "hf_config_path": "model_config"}
# Extra spellings accepted on the command line.
FLAG_ALIASES = {"attn": ["--attention-backend"], "cache": ["--prefix-cache"]}
# Flags whose name differs from the field name.
FLAG_NAMES = {"hf_config_path": "--model-config"}
SERVER_ONLY = {
    "host", "port", "api_key", "served_model_name", "shell", "log_level", "shutdown_timeout", "health_timeout",
    "max_request_bytes", "max_prompts", "max_n", "stall_timeout", "tokenizer_workers",
}  # fmt: skip


class ServeSettings(BaseSettings):
    """Everything ``minisgl serve`` and ``minisgl chat`` can be told."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=(), populate_by_name=True, validate_default=True
    )

    model: str = Field(description="Hugging Face model directory or .gguf file")
    # engine
    attn: str = Field("auto", description="attention backend: NAME or PREFILL,DECODE; auto = best installed")
    cache: str = Field("auto", description="prefix cache (e.g. naive, radix); auto = best installed")
    kv_pool: str = Field("mha", description="KV cache pool layout")
    moe_backend: str = Field("auto", description="mixture-of-experts backend (MoE models only)")
    page_size: int = Field(16, ge=1, description="tokens per KV cache page")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight and activation dtype; auto = float32 on CPU, the model's dtype on GPU"
    )
    device: str = Field("auto", description="cpu, cuda or cuda:N; auto = cuda when a GPU is visible")
    max_running_requests: int | None = Field(
        None, ge=1, description="most requests decoded together; default: 256 on a GPU, 64 on CPU"
    )
    chunked_prefill_size: int | None = Field(
        None,
        ge=1,
        description="prompt tokens computed per step (longer prompts are split); default: 8192 on a GPU, 512 on CPU",
    )
    max_model_len: int | None = Field(None, ge=1, description="context length; default: the model's")
    num_pages: int | None = Field(None, ge=2, description="KV cache pages; default: sized from memory")
    mem_fraction: float = Field(0.85, gt=0, le=1, description="share of free GPU memory for the KV cache")
    cpu_kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU, in GiB")
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy = random weights (benchmarks)")
    hf_config_path: str | None = Field(
        None,
        validation_alias=AliasChoices("hf_config_path", f"{ENV_PREFIX}MODEL_CONFIG"),
        description="config.json to use instead of the model's (with --load-format dummy: no weights needed)",
    )
    seed: int = Field(0, description="seed of the sampler for requests without their own seed")
    cuda_graph_max_bs: int = Field(256, ge=0, description="largest decode batch captured in a CUDA graph; 0 = none")
    overlap_schedule: bool = Field(True, description="overlap scheduling with the GPU step")
    tp: int = Field(1, ge=1, description="tensor-parallel size (number of GPUs; processes on CPU)")
    nnodes: int = Field(1, ge=1, description="nodes the tensor-parallel ranks span")
    node_rank: int = Field(0, ge=0, description="this node's index; nodes other than 0 run ranks only, no API")
    dist_init_addr: str | None = Field(None, description="HOST:PORT of rank 0's rendezvous (several nodes)")
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
    shell: bool = Field(False, description="chat in this terminal instead of serving HTTP")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")
    shutdown_timeout: float = Field(
        5.0, ge=0, description="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are ended"
    )
    # request limits (see minisgl.server.limits)
    max_request_bytes: int = Field(
        2 * 2**20, ge=1024, description="largest request body in bytes; a larger one is refused (413) unread"
    )
    max_prompts: int = Field(32, ge=1, description="most prompts in one /v1/completions request")
    max_n: int = Field(16, ge=1, le=128, description="most choices (n) per prompt")

    def engine_fields(self) -> dict[str, Any]:
        """The :class:`~minisgl.config.EngineConfig` keyword arguments these settings describe."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            if name in SERVER_ONLY:
                continue
            out[ENGINE_FIELD_NAMES.get(name, name)] = getattr(self, name)
        return out

    @property
    def model_name(self) -> str:
        """The name clients use in the ``model`` field."""
        if self.served_model_name:
            return self.served_model_name
        from pathlib import PurePath

        from ..utils.model_path import DIST_PREFIX, ModelPathError, resolve_model_path

        path = PurePath(self.model.rstrip("/"))
        if self.model.startswith(DIST_PREFIX):
            try:
                path = resolve_model_path(self.model)
            except ModelPathError:
                return self.model
        return path.stem if path.suffix == ".gguf" else path.name


def flag_name(field: str) -> str:
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def env_name(field: str) -> str:
    return ENV_PREFIX + (FLAG_NAMES.get(field, field)).lstrip("-").replace("-", "_").upper()


def _plain_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(argparse type, choices) of a field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _plain_type(inner[0])
    if typing.get_origin(annotation) is Literal:
        return str, list(args)
    return annotation, None


def build_parser(prog: str = "minisgl serve", *, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per settings field; unset flags stay unset (the environment applies)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        epilog=f"Every flag can also be set with an environment variable: {ENV_PREFIX}<FLAG NAME> "
        f"(e.g. {ENV_PREFIX}MAX_RUNNING_REQUESTS=32). A flag wins over the environment.",
    )
    groups = {
        "model": parser.add_argument_group("model and engine"),
        "server": parser.add_argument_group("server"),
    }
    for name, info in ServeSettings.model_fields.items():
        group = groups["server" if name in SERVER_ONLY else "model"]
        if info.is_required():
            help_text = f"{info.description} (required; env {env_name(name)})"
        elif info.default is None:
            help_text = f"{info.description} (env {env_name(name)})"
        else:
            help_text = f"{info.description} (default: {info.default}; env {env_name(name)})"
        flags = [flag_name(name), *FLAG_ALIASES.get(name, [])]
        kind, choices = _plain_type(info.annotation)
        if kind is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else name.split("_")[-1].upper()
            group.add_argument(*flags, dest=name, type=kind, choices=choices, metavar=metavar, help=help_text)
    return parser


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the flag and its environment variable."""


def settings_from_args(values: dict[str, Any]) -> ServeSettings:
    """Flag values (unset flags absent) plus ``MINISGL_*`` environment variables -> :class:`ServeSettings`.

    Raises :class:`SettingsError` naming each bad flag and its environment variable.
    """
    try:
        return ServeSettings(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            if field.startswith(ENV_PREFIX):
                field = "hf_config_path"
            where = f"{flag_name(field)} (env {env_name(field)})" if field in ServeSettings.model_fields else field
            if err["type"] == "missing":
                problems.append(f"{where} is required")
            else:
                problems.append(f"{where}: {err['msg']}, got {err.get('input')!r}")
        raise SettingsError("; ".join(problems)) from None


def parse_settings(argv: list[str], *, prog: str = "minisgl serve", description: str = "") -> ServeSettings:
    """Parse ``minisgl serve`` arguments (see :func:`settings_from_args`)."""
    return settings_from_args(vars(build_parser(prog, description=description).parse_args(argv)))
