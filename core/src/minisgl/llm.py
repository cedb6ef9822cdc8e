"""The offline Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .config import EngineConfig
from .core import Req, SamplingParams, TokenLogprob
from .plugins import PluginRegistry
from .scheduler.tp import start_scheduler, step_naming_dead_rank


@dataclass
class RequestOutput:
    """The result of one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLM:
    """An engine and scheduler in this process, for batch generation; keyword arguments are
    :class:`~minisgl.config.EngineConfig` fields (a batch job of a large model may want
    ``schedule_policy="throughput"``: docs/user-guide.md, "Scheduling for throughput")."""

    def __init__(self, model: str, *, registry: PluginRegistry | None = None, tokenizer: Any = None, **kwargs: Any):
        self.config = EngineConfig(model=model, **kwargs)
        self._ranks: Any  # RankProcesses with tp > 1, else None
        self.scheduler, self._ranks, self.tokenizer = start_scheduler(self.config, registry, tokenizer)
        self.engine = self.scheduler.engine
        self.eos_token_ids = self.scheduler.eos_token_ids
        self._closed = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the engine's memory (and stop tensor-parallel ranks). The object is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        for req in self.scheduler.live_requests():
            self.scheduler.abort(req.rid)
        self.scheduler.close()  # the step trace's last lines
        if self._ranks is not None:
            self._ranks.shutdown(self.scheduler)
        del self.scheduler, self.engine
        gc.collect()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer; pass token id lists as prompts")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if self._closed:
            raise RuntimeError("this LLM has been closed")
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list: list[Any] = [prompts] if single else list(prompts)
        params = SamplingParams() if params is None else params
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} sampling params")
        sched, ranks = self.scheduler, self._ranks
        reqs = []
        try:
            for p, sp in zip(prompt_list, param_list):
                reqs.append(sched.add_request(self.encode(p), sp))
            bar = tqdm(total=len(reqs), desc="generate", unit="req", leave=False, disable=not use_tqdm or len(reqs) < 2)
            while any(not r.is_finished for r in reqs):
                if ranks is not None:
                    ranks.check_alive()  # a dead rank would hang the next collective: fail now instead
                events = step_naming_dead_rank(sched, ranks)
                bar.update(sum(1 for e in events if e.finished))
                for _, error in sched.take_grammar_outcomes():
                    if error is not None:  # its grammar did not compile: refused, as at add_request
                        raise error
            bar.close()
        except BaseException:
            for r in reqs:
                sched.abort(r.rid)
            raise
        return [self._output(r) for r in reqs]

    def _output(self, req: Req) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
            # Cut at the first stop string, as a server stream does.
            cut = min((i for i in (text.find(s) for s in req.params.stop_strings) if i >= 0), default=-1)
            text = text[:cut] if cut >= 0 else text
        return RequestOutput(
            req.input_ids, list(req.output_ids), text, req.finish_reason or "length", req.prefix_len, list(req.logprobs)
        )

    def check_accounting(self) -> None:
        """Assert that every KV page is free, cached, or owned by a live request."""
        self.scheduler.check_accounting()

    @property
    def kv_pages_in_use(self) -> int:
        """Pages owned by live requests (not free and not held by the prefix cache)."""
        return self.scheduler.kv.used_pages - self.scheduler.kv.cache_pages
