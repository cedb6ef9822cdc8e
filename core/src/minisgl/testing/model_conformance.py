"""Conformance kit for model plugins: a tiny random model, run by the engine, checked against transformers.

Subclass :class:`ModelConformance` in a test module, with a name starting with
``Test``, and name the architecture; pytest collects the inherited tests::

    from minisgl.testing.model_conformance import ModelConformance

    class TestPhi3(ModelConformance):
        architecture = "Phi3ForCausalLM"      # the transformers class, and the name your ModelSpec registers
        config_overrides = {"partial_rotary_factor": 0.5, "pad_token_id": 0}  # over the tiny defaults
        provider = "phi3"                     # optional: the plugin entry that must provide the model

The kit builds a tiny random model of that architecture with transformers
(:func:`~minisgl.testing.models.save_tiny_model`: hidden 64, 2 layers, vocab 512,
weights scaled so greedy choices are clear), loads the saved checkpoint through
:class:`minisgl.LLM` on the CPU in float32, generates greedily with logprobs and
checks every generated token against transformers run on the same checkpoint:

- the token is transformers' greedy choice (argmax of its next-token distribution,
  computed by teacher forcing on prompt + output); a choice within ``tie_margin`` of
  the maximum counts as a tie and passes;
- the token's logprob, and each of the ``top_logprobs`` alternatives' logprobs,
  equal transformers' within ``logprob_atol`` (1e-4 by default: float32 on both sides
  differs by about 1e-5 here);
- every request finishes by length, and the KV accounting is exact afterwards.

Scenarios: every prompt in one batch at each of ``page_sizes`` (1, 4, 16); chunked
prefill (``chunked_prefill_size`` 16, so most prompts take several chunks) at the
same page sizes; a mixed batch where requests arrive one per step while others
prefill and decode (page 4, chunked, at most 3 running), one of them sharing a
prompt prefix with another; and logits at every prompt position of a prefill batch
(atol ``logit_atol``). A failure names the scenario, the prompt, the position, the
token ids and both logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from ..core import SamplingParams, TokenLogprob
from ..plugins import PluginRegistry, load_plugins
from . import models
from .kv_pool import skip_without_device
from .models import hf_logprobs, random_prompts, save_tiny_model, tiny_config


def prefill_logits(llm: Any, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Float32 logits (on the CPU) at every position of ``prompts``, run as one prefill batch of ``llm``
    (a :class:`minisgl.LLM` with nothing running); the batch's KV pages are freed again."""
    return models.prefill_logits(llm, [list(p) for p in prompts]).cpu()


@dataclass
class TinyModel:
    """A saved tiny model and what transformers makes of it (one per test class)."""

    architecture: str
    path: Path
    hf_model: Any  # the transformers model, eval mode, float32 on the CPU
    prompts: list[list[int]]
    _references: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_model.config.vocab_size)

    def reference(self, prompt: list[int], output: list[int]) -> torch.Tensor:
        """Transformers' logprobs for each token of ``output`` after ``prompt`` (cached: the scenarios agree)."""
        key = (len(prompt), *prompt, *output)
        if key not in self._references:
            self._references[key] = hf_logprobs(self.hf_model, prompt, output)
        return self._references[key]


class ModelConformance:
    """Base class of a model plugin's conformance tests. Set ``architecture``; the rest has defaults."""

    #: The transformers model class name; also the name the plugin's ``ModelSpec`` registers.
    architecture: str = ""
    #: Config fields over :func:`~minisgl.testing.models.tiny_config`'s tiny defaults.
    config_overrides: dict[str, Any] = {}
    #: Plugin entry names to load (``None``: every installed plugin, as ``LLM`` does).
    plugins: Sequence[str] | None = None
    #: The plugin entry expected to provide ``architecture`` (``None``: any).
    provider: str | None = None
    device: str = "cpu"
    page_sizes: tuple[int, ...] = (1, 4, 16)
    chunked_prefill_size: int = 16
    prompt_lengths: tuple[int, ...] = (5, 17, 70, 33, 1, 48)
    max_new_tokens: int = 12
    #: Alternatives asked for with each token (``SamplingParams.logprobs``); their logprobs are checked too.
    top_logprobs: int = 2
    logprob_atol: float = 1e-4
    logit_atol: float = 1e-4
    #: A token whose transformers logprob is within this of the best one is an acceptable greedy choice.
    tie_margin: float = 1e-4
    seed: int = 0
    #: Extra ``LLM`` keyword arguments for every engine the kit builds (e.g. ``attention_backend``).
    engine_kwargs: dict[str, Any] = {}

    # ------------------------------------------------------------------ hooks
    def make_config(self) -> Any:
        """The transformers config of the tiny model (override for full control, e.g. MoE sizes)."""
        return tiny_config(self.architecture, **self.config_overrides)

    def load_registry(self) -> PluginRegistry:
        """The plugins the engine is built from (override to add an uninstalled plugin: ``load_plugins(extra=...)``)."""
        return load_plugins(self.plugins)

    def make_llm(self, model: TinyModel, **kwargs: Any) -> Any:
        """An engine on the tiny checkpoint: float32 on ``device``, with ``engine_kwargs`` and ``kwargs``."""
        from ..llm import LLM

        args: dict[str, Any] = {"device": self.device, "dtype": "float32", "max_running_requests": 8}
        args.update(self.engine_kwargs)
        args.update(kwargs)
        return LLM(str(model.path), registry=self.load_registry(), **args)

    # ---------------------------------------------------------------- fixture
    @classmethod
    def build_tiny_model(cls, path: Path) -> TinyModel:
        """Save the tiny model to ``path`` and return it with its transformers twin and the prompts."""
        hf = save_tiny_model(cls.architecture, path, seed=cls.seed, config=cls().make_config())
        vocab = int(hf.config.vocab_size)
        prompts = random_prompts(cls.prompt_lengths, vocab, seed=cls.seed + 1)
        # One prompt shares the start of another (a prefix-cache hit when it arrives after it).
        longest = max(prompts, key=len)
        prompts.append(longest[: len(longest) // 2] + random_prompts([7], vocab, cls.seed + 2)[0])
        return TinyModel(cls.architecture, path, hf, prompts)

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model(cls, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
        """:meth:`build_tiny_model`, once per test class."""
        if not cls.architecture:
            pytest.fail(f"{cls.__name__}: set architecture (the model's transformers class name)")
        skip_without_device(cls.device)
        return cls.build_tiny_model(tmp_path_factory.mktemp(cls.architecture))

    # ---------------------------------------------------------------- checks
    def _params(self) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=self.max_new_tokens, ignore_eos=True, logprobs=self.top_logprobs
        )

    def check_outputs(
        self, model: TinyModel, scenario: str, prompts: list[list[int]], outputs: list[list[int]], logprobs: list[Any]
    ) -> None:
        """Each output token is transformers' greedy choice with transformers' logprobs (module docstring)."""
        problems: list[str] = []
        worst = 0.0
        for i, (prompt, out, lps) in enumerate(zip(prompts, outputs, logprobs, strict=True)):
            where = f"prompt {i} ({len(prompt)} tokens)"
            if len(out) != self.max_new_tokens:
                problems.append(f"{where}: {len(out)} tokens generated, expected {self.max_new_tokens}")
                continue
            if len(lps) != len(out):
                problems.append(f"{where}: {len(lps)} logprobs for {len(out)} tokens")
                continue
            ref = model.reference(prompt, out)
            for pos, (tok, lp) in enumerate(zip(out, lps, strict=True)):
                row = ref[pos]
                best = int(row.argmax())
                at = f"{where}, output token {pos}"
                if row[tok] < row[best] - self.tie_margin:
                    problems.append(
                        f"{at}: engine chose {tok} (transformers logprob {row[tok]:.5f}), "
                        f"transformers chose {best} ({row[best]:.5f})"
                    )
                    break  # what follows continues from a different token; the first divergence is the news
                assert isinstance(lp, TokenLogprob)
                if lp.token_id != tok:
                    problems.append(f"{at}: logprob reported for token {lp.token_id}, generated {tok}")
                    break
                pairs = [(tok, lp.logprob), *lp.top]
                if len(lp.top) != self.top_logprobs:
                    problems.append(f"{at}: {len(lp.top)} alternatives reported, asked for {self.top_logprobs}")
                kth = row.topk(len(lp.top)).values[-1].item() if lp.top else 0.0
                for tid, value in pairs:
                    err = abs(value - row[tid].item())
                    worst = max(worst, err)
                    if err > self.logprob_atol:
                        problems.append(
                            f"{at}: logprob of token {tid} is {value:.6f}, transformers {row[tid].item():.6f} "
                            f"(|diff| {err:.2e} > logprob_atol {self.logprob_atol:.0e})"
                        )
                for tid, _ in lp.top:
                    if row[tid].item() < kth - self.tie_margin:
                        problems.append(f"{at}: alternative {tid} is not among transformers' top {len(lp.top)}")
        if problems:
            shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise AssertionError(
                f"{self.architecture}, {scenario}: the engine disagrees with transformers\n  {shown}\n"
                f"(largest logprob difference seen: {worst:.2e})"
            )

    def _generate(self, model: TinyModel, scenario: str, **engine: Any) -> None:
        with self.make_llm(model, **engine) as llm:
            outs = llm.generate(model.prompts, self._params(), use_tqdm=False)
            assert [o.finish_reason for o in outs] == ["length"] * len(outs), (
                f"{scenario}: finish reasons {[o.finish_reason for o in outs]}"
            )
            llm.check_accounting()
            assert llm.kv_pages_in_use == 0, f"{scenario}: {llm.kv_pages_in_use} KV pages still held"
        self.check_outputs(model, scenario, model.prompts, [o.token_ids for o in outs], [o.logprobs for o in outs])

    # ------------------------------------------------------------------ tests
    def test_registered(self, tiny_model: TinyModel) -> None:
        """The architecture is registered (by ``provider`` when set) and builds a ``CausalLM``."""
        reg = self.load_registry()
        assert reg.has("model", self.architecture), (
            f"no installed plugin provides the model '{self.architecture}'; models: {', '.join(reg.names('model'))}"
        )
        if self.provider is not None:
            got = reg.provider("model", self.architecture).name
            assert got == self.provider, f"'{self.architecture}' comes from plugin '{got}', expected '{self.provider}'"

    def test_greedy_matches_transformers(self, tiny_model: TinyModel, page_size: int) -> None:
        """Every prompt in one batch, each prefilled whole."""
        chunk = max(64, sum(len(p) for p in tiny_model.prompts))
        self._generate(tiny_model, f"page size {page_size}", page_size=page_size, chunked_prefill_size=chunk)

    def test_chunked_prefill(self, tiny_model: TinyModel, page_size: int) -> None:
        """Prompts longer than ``chunked_prefill_size`` are prefilled in several steps."""
        chunk = self.chunked_prefill_size
        assert max(len(p) for p in tiny_model.prompts) > chunk, "set prompt_lengths longer than chunked_prefill_size"
        self._generate(
            tiny_model, f"page size {page_size}, chunks of {chunk}", page_size=page_size, chunked_prefill_size=chunk
        )

    def test_staggered_arrivals(self, tiny_model: TinyModel) -> None:
        """One request arrives per step while others prefill (in chunks) and decode; at most 3 run at once."""
        scenario = f"requests arriving one per step (page size 4, chunks of {self.chunked_prefill_size}, 3 running)"
        params = self._params()
        page_size = 4 if 4 in self.page_sizes else self.page_sizes[0]
        with self.make_llm(
            tiny_model, page_size=page_size, chunked_prefill_size=self.chunked_prefill_size, max_running_requests=3
        ) as llm:
            sched = llm.scheduler
            pending = list(tiny_model.prompts)
            reqs = [sched.add_request(pending.pop(0), params)]
            steps = 0
            while pending or any(not r.is_finished for r in reqs):
                sched.step()
                steps += 1
                assert steps < 10_000, f"{scenario}: requests never finished"
                if pending:
                    reqs.append(sched.add_request(pending.pop(0), params))
            while sched.step():  # drain the step still in flight (overlap scheduling)
                pass
            llm.check_accounting()
            assert llm.kv_pages_in_use == 0, f"{scenario}: {llm.kv_pages_in_use} KV pages still held"
        self.check_outputs(
            tiny_model, scenario, tiny_model.prompts, [r.output_ids for r in reqs], [r.logprobs for r in reqs]
        )

    def test_prefill_logits(self, tiny_model: TinyModel) -> None:
        """Logits at every prompt position of a batch of prompts, against transformers' (``logit_atol``)."""
        prompts = tiny_model.prompts[:3]
        with self.make_llm(tiny_model, page_size=self.page_sizes[-1]) as llm:
            logits = prefill_logits(llm, prompts)
        start = 0
        for i, p in enumerate(prompts):
            with torch.no_grad():
                ref = tiny_model.hf_model(torch.tensor([p])).logits[0].float()
            got = logits[start : start + len(p)]
            start += len(p)
            err = (got - ref).abs().max(dim=-1).values
            bad = (err > self.logit_atol).nonzero().flatten().tolist()
            assert not bad, (
                f"{self.architecture}, prefill logits of prompt {i} ({len(p)} tokens): positions {bad[:10]} differ "
                f"from transformers by up to {err.max().item():.2e} (logit_atol {self.logit_atol:.0e})"
            )

    # ------------------------------------------------------------ parameters
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """pytest's hook, on the class: ``page_size`` runs over this class's ``page_sizes``."""
        if "page_size" in metafunc.fixturenames:
            metafunc.parametrize("page_size", list(self.page_sizes), ids=[f"page{s}" for s in self.page_sizes])
