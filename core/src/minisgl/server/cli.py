"""``minisgl serve``: check the settings cheaply, then start the server (or a terminal chat).

Everything that can be wrong without loading the model (flag values, backend
and cache names against the installed plugins, the model path) is checked
here, before any worker process starts, so a typo fails in well under a second.
"""

from __future__ import annotations

import sys

from .settings import ENGINE_FIELD_NAMES, ServeSettings, SettingsError, env_name, flag_name, parse_settings

DESCRIPTION = "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."


class PreflightError(ValueError):
    """Settings that were well formed but cannot work (unknown backend, missing model, ...)."""


def _flag_for_engine_field(engine_field: str) -> str:
    reverse = {v: k for k, v in ENGINE_FIELD_NAMES.items()}
    name = reverse.get(engine_field, engine_field)
    return f"{flag_name(name)} (env {env_name(name)})"


def preflight(settings: ServeSettings) -> list[str]:
    """Check the settings without loading anything heavy; return the active plugin names for the workers."""
    from ..config import EngineConfig
    from ..core import ValidationError
    from ..plugins import UnknownComponentError, load_plugins
    from .engine_build import device_defaults, likely_device

    fields = settings.engine_fields()
    device = fields["device"]
    check_device = "cpu" if device == "auto" else device
    limits = {k: v for k, v in device_defaults(check_device).items() if fields.get(k) is None}
    try:
        EngineConfig(**{**fields, **limits, "device": check_device})
    except ValidationError as exc:
        raise PreflightError(f"{_flag_for_engine_field(exc.field)}: {exc.message}") from None
    if not (settings.load_format == "dummy" and settings.hf_config_path):
        from ..utils.model_path import ModelPathError, resolve_model_path

        try:
            resolve_model_path(settings.model)
        except ModelPathError as exc:
            raise PreflightError(f"--model: {exc}") from None
    registry = load_plugins()
    # A component named for a device it cannot run on fails here, with its reason, before any worker starts.
    target = device.split(":")[0] if device != "auto" else likely_device()
    checks = [("attention", n.strip()) for n in settings.attn.split(",")]
    checks += [("prefix_cache", settings.cache), ("kv_pool", settings.kv_pool), ("moe", settings.moe_backend)]
    flags = {"attention": "--attn", "prefix_cache": "--cache", "kv_pool": "--kv-pool", "moe": "--moe-backend"}
    for kind, name in checks:
        if not name:
            raise PreflightError(f"--attn: expected NAME or PREFILL,DECODE, got '{settings.attn}'")
        try:
            if target is not None:
                registry.pick(kind, name, target)  # type: ignore[arg-type]
            elif name != "auto":
                registry.get(kind, name)  # type: ignore[arg-type]
        except UnknownComponentError as exc:
            raise PreflightError(f"{flags[kind]}: {exc}") from None
    return registry.active_plugin_names()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_settings(args, prog="minisgl serve", description=DESCRIPTION)
        plugins = preflight(settings)
    except (SettingsError, PreflightError) as exc:
        print(f"minisgl serve: error: {exc}", file=sys.stderr)
        return 2
    if settings.node_rank > 0:
        # Another node of a multi-node tensor-parallel group: it runs engine ranks only.
        from ..scheduler.tp import run_follower_node
        from .engine_build import engine_config

        return run_follower_node(engine_config({**settings.engine_fields(), "plugins": plugins}))
    if settings.shell:
        from .chat import run_chat

        return run_chat(settings, plugins)
    from .launcher import serve

    return serve(settings, plugins)


if __name__ == "__main__":
    sys.exit(main())
