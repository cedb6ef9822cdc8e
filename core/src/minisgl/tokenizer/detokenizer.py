"""The detokenizer process: the scheduler's token ids become text for the API server.

Requests are announced in ``StepOutput.accepted``. Stop strings are checked here only: a request that
reaches one is finished at once and the scheduler is told to free it (:class:`~minisgl.message.StopReq`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..message import OutputBatch, StepOutput
from .detokenize import IncrementalDetokenizer


@dataclass
class _Live:
    detok: IncrementalDetokenizer | None
    logprobs: bool
    prompt_tokens: int
    completion_tokens: int = 0


class DetokenizerService:
    """Turns :class:`StepOutput` into :class:`OutputBatch`; no sockets, so it is testable on its own."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.live: dict[int, _Live] = {}

    def process(self, step: StepOutput) -> tuple[OutputBatch, list[int]]:
        """The outputs of one step, and the requests a stop string finished (the scheduler must free them)."""
        tok = self.tokenizer
        for rid, prompt_tokens, stop, skip_special, logprobs in step.accepted:
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special, stop=stop) if tok else None
            self.live[rid] = _Live(detok, bool(logprobs), int(prompt_tokens))
        out = OutputBatch(failed=step.failed, logprobs=[] if step.logprobs is not None else None)
        ends = {e[0]: e for e in step.finished}
        stopped: list[int] = []
        live_map = self.live
        for i, (rid, token) in enumerate(zip(step.rids, step.tokens, strict=True)):
            live = live_map.get(rid)
            if live is None:  # aborted, or already finished by a stop string
                continue
            end = ends.get(i)
            if token >= 0:
                live.completion_tokens += 1
            reason: str | None = None
            text = ""
            detok = live.detok
            if detok is not None:
                if token < 0 or (end is not None and end[2]):  # no token, or a stop token: no text of its own
                    text = detok.finish()
                else:
                    text = detok.push(token, final=end is not None)
                if detok.stopped:
                    reason = "stop"
                    if end is None:
                        stopped.append(rid)  # still running in the scheduler
            if reason is None and end is not None:
                reason = end[1]
            if reason is not None:
                del live_map[rid]
                cached = int(end[3]) if end is not None else 0
                out.finished.append([len(out.rids), reason, live.prompt_tokens, cached])
            out.rids.append(rid)
            out.texts.append(text)
            out.counts.append(live.completion_tokens)
            if out.logprobs is not None:
                entry = step.logprobs[i] if live.logprobs else None  # type: ignore[index]
                out.logprobs.append(self._logprob_entry(token, entry) if entry is not None else None)
        for rid in step.dropped:
            live_map.pop(rid, None)
        for rid, _, _ in step.failed:
            live_map.pop(rid, None)
        return out, stopped

    def _logprob_entry(self, token: int, entry: list[Any]) -> list[Any]:
        logprob, top = entry
        return [[self._token_text(token), float(logprob), [[self._token_text(int(t)), float(lp)] for t, lp in top]]]

    def _token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"<{token}>"
        return str(self.tokenizer.decode([token], skip_special_tokens=False))
