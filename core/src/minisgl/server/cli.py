"""``minisgl serve``: check the settings cheaply (a typo fails in well under a second, before any worker starts),
then start the server (or a terminal chat)."""

from __future__ import annotations

import sys

from .settings import PreflightError, SettingsError, parse_settings, preflight

DESCRIPTION = "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."


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
        from ..config import EngineConfig
        from ..scheduler.tp import run_follower_node

        return run_follower_node(EngineConfig(**settings.engine_fields(), plugins=tuple(plugins)))
    if settings.dp > 1:
        from .replicas import serve_replicas

        return serve_replicas(settings, args)
    if settings.shell:
        from .chat import run_chat

        return run_chat(settings, plugins)
    from .launcher import serve

    return serve(settings, plugins)


if __name__ == "__main__":
    sys.exit(main())
