"""``minisgl chat`` (and ``minisgl serve --shell``): chat with a model in the terminal, the engine in-process.

The conversation is sent whole each turn, through the chat template; replies stream token by token.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from .settings import PreflightError, ServeSettings, SettingsError, build_parser, preflight, settings_from_args

DESCRIPTION = "Chat with a model in this terminal (the engine runs in-process)."
HELP_TEXT = "Commands: /reset clears the conversation, /exit quits. Ctrl-C stops a reply."


def run_chat(
    settings: ServeSettings,
    plugins: list[str],
    *,
    temperature: float = 0.7,
    max_tokens: int = 512,
    system: str | None = None,
) -> int:
    """Load the model and chat until /exit or end of input; Ctrl-C stops the reply being written."""
    from ..core import SamplingParams, ValidationError
    from ..llm import LLM
    from ..tokenizer import IncrementalDetokenizer
    from .workers import user_error

    try:
        fields = settings.engine_fields()
        llm = LLM(fields.pop("model"), **fields, plugins=tuple(plugins))
    except Exception as exc:  # start-up errors are the user's to fix: show them, no traceback
        print(f"minisgl chat: error: {user_error(exc)}", file=sys.stderr)
        return 1
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        print("minisgl chat: error: the model has no tokenizer with a chat template", file=sys.stderr)
        return 1
    try:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=settings.seed)
    except ValidationError as exc:
        print(f"minisgl chat: error: --{exc.field.replace('_', '-')}: {exc.message}", file=sys.stderr)
        return 2
    sched = llm.scheduler
    start: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    history = list(start)
    print(f"minisgl chat: {settings.model_name}. {HELP_TEXT}", flush=True)
    while True:
        print(">>> ", end="", flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as shells do
            print()
            continue
        if not line:
            print()
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(start)
            print("(conversation cleared)", flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}. {HELP_TEXT}", flush=True)
            continue
        history.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        # Long conversations get shorter replies rather than none, until the prompt alone fills the context.
        room = int(sched.engine.max_model_len) - len(ids)
        turn = replace(params, max_tokens=max(1, min(max_tokens, room)))
        try:
            req = sched.add_request(ids, turn)
        except ValidationError as exc:
            history.pop()
            print(f"(cannot answer: {exc.message}; /reset starts a new conversation)", flush=True)
            continue
        reply = _stream_reply(sched, req, IncrementalDetokenizer(tokenizer))
        history.append({"role": "assistant", "content": reply})
    llm.close()
    return 0


def _stream_reply(sched: Any, req: Any, detok: Any) -> str:
    parts: list[str] = []
    try:
        while not req.is_finished:
            for ev in sched.step():
                if ev.req is not req:
                    continue
                stop_token = ev.finished and (ev.token in req.eos_token_ids or ev.token in req.params.stop_ids)
                piece = detok.finish() if stop_token else detok.push(ev.token, final=ev.finished)
                if piece:
                    parts.append(piece)
                    print(piece, end="", flush=True)
    except KeyboardInterrupt:
        sched.abort(req.rid)
        print(" (stopped)", end="")
    print(flush=True)
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("minisgl chat", description=DESCRIPTION)
    group = parser.add_argument_group("chat")
    group.add_argument("--temperature", type=float, help="sampling temperature; 0 = greedy (default: 0.7)")
    group.add_argument("--max-tokens", type=int, help="longest reply in tokens (default: 512)")
    group.add_argument("--system", type=str, help="system prompt (default: none; the template's own if it has one)")
    values = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    chat = {k: values.pop(k) for k in ("temperature", "max_tokens", "system") if k in values}
    try:
        settings = settings_from_args(values)
        plugins = preflight(settings)
    except (SettingsError, PreflightError) as exc:
        print(f"minisgl chat: error: {exc}", file=sys.stderr)
        return 2
    return run_chat(settings, plugins, **chat)


if __name__ == "__main__":
    sys.exit(main())
