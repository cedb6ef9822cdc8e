"""Engine and scheduler behaviour: accounting, abort, chunking, errors."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import ValidationError
from minisgl.plugins import UnknownComponentError
from minisgl.testing.models import hf_greedy, random_prompts


def test_matches_transformers_with_core_only(make_llm, hf_model) -> None:
    prompts = random_prompts([5, 120, 33], 512, seed=2)
    expected = hf_greedy(hf_model, prompts, 12)
    for page_size, chunk in [(1, 512), (16, 40)]:
        llm = make_llm(page_size=page_size, chunked_prefill_size=chunk)
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in out] == expected


def test_text_prompts_and_token_prompts_agree(make_llm) -> None:
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate(["w5 w17 w300 w4"], params)[0]
    by_ids = llm.generate([[5, 17, 300, 4]], params)[0]
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == " ".join(f"w{t}" for t in by_ids.token_ids)


def test_admission_waits_for_pages_and_everything_completes(make_llm) -> None:
    """A pool with room for two requests at a time still completes eight, in order."""
    llm = make_llm(page_size=4, num_pages=1 + 2 * 30, max_running_requests=8)
    prompts = random_prompts([40] * 8, 512, seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reqs = [llm.scheduler.add_request(p, params) for p in prompts]
    peak = 0
    while llm.scheduler.has_work:
        llm.scheduler.step()
        peak = max(peak, llm.scheduler.num_running)
        llm.check_accounting()
    assert peak == 2
    assert all(len(r.output_ids) == 60 for r in reqs)


def test_abort_returns_pages_at_any_point(make_llm) -> None:
    llm = make_llm(chunked_prefill_size=16)
    sched = llm.scheduler
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    reqs = [sched.add_request(p, params) for p in random_prompts([70, 10, 30], 512, seed=5)]
    sched.step()  # the first prompt is only partly prefilled
    assert sched.abort(reqs[0].rid) is reqs[0]
    for _ in range(6):
        sched.step()
    sched.abort(reqs[1].rid)
    assert sched.abort(reqs[1].rid) is None  # already finished
    llm.check_accounting()
    while sched.has_work:
        sched.step()
    assert [r.finish_reason for r in reqs] == ["abort", "abort", "length"]


def test_prompt_longer_than_context_is_rejected(make_llm) -> None:
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValidationError, match="the prompt has 80 tokens, but the context length is 64"):
        llm.generate([[5] * 80], SamplingParams(max_tokens=4))
    with pytest.raises(
        ValidationError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds the context length 64"
    ):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))


def test_bad_prompts_are_rejected(make_llm) -> None:
    llm = make_llm()
    with pytest.raises(ValidationError, match="prompt is empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValidationError, match=r"token id 600 is outside the vocabulary \[0, 512\)"):
        llm.generate([[5, 600]], SamplingParams())


def test_request_that_can_never_fit_gets_a_clear_error(make_llm) -> None:
    llm = make_llm(page_size=4, num_pages=9)
    with pytest.raises(
        ValidationError, match=r"needs 40 tokens of KV cache \(10 pages\) but the pool has only 8 pages"
    ):
        llm.generate([[5] * 20], SamplingParams(max_tokens=20))


def test_a_failed_batch_submission_leaks_nothing(make_llm) -> None:
    """If one prompt of a batch is invalid, the ones queued before it are withdrawn."""
    llm = make_llm()
    with pytest.raises(ValidationError):
        llm.generate([[5, 6, 7], [8] * 5000], SamplingParams(max_tokens=4))
    assert not llm.scheduler.has_work


def test_sampling_params_validation() -> None:
    with pytest.raises(ValidationError, match="temperature: must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError, match="top_p: must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValidationError, match="max_tokens: must be a positive integer"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValidationError, match="stop: stop strings must be non-empty"):
        SamplingParams(stop=[""])


def test_unknown_components_name_what_is_installed(tiny_dir, registry) -> None:
    with pytest.raises(
        UnknownComponentError,
        match=r"unknown attention backend 'flashinfr'; installed: torch \(minisgl\)",
    ):
        LLM(str(tiny_dir), registry=registry, attention_backend="flashinfr")
    with pytest.raises(UnknownComponentError, match=r"unknown kernel set 'nativ'; installed: torch \(minisgl\)"):
        LLM(str(tiny_dir), registry=registry, kernels="nativ")
    # A name no plugin of the project provides: no install hint for a package that may not exist, a pointer to the
    # listing. A first-party name (fa) names its package (the registry fixture holds only the core's built-ins).
    with pytest.raises(UnknownComponentError, match="unknown attention backend 'nope'.*`minisgl plugins` lists") as err:
        LLM(str(tiny_dir), registry=registry, attention_backend="nope")
    assert "pip install" not in str(err.value)
    # Where minisgl-plugin-fa is installed (every package together), the fixture's plugin list leaves it inactive:
    # then the message says so instead of asking to install what is there.
    fa_installed = any(p.distribution == "minisgl-plugin-fa" for p in registry.plugins)
    hint = (
        "'fa' is provided by minisgl-plugin-fa, which is installed but disabled: not in the plugin list"
        if fa_installed
        else "'fa' is provided by minisgl-plugin-fa: pip install minisgl-plugin-fa"
    )
    with pytest.raises(UnknownComponentError, match=hint):
        LLM(str(tiny_dir), registry=registry, attention_backend="fa")


def test_unknown_architecture_is_reported(tmp_path, registry) -> None:
    from minisgl.testing.models import save_tiny_model

    save_tiny_model("Qwen3ForCausalLM", tmp_path)
    with pytest.raises(
        UnknownComponentError,
        match=r"unknown model architecture 'Qwen3ForCausalLM'; installed: LlamaForCausalLM"
        r".*docs/plugins.md",
    ):
        LLM(str(tmp_path), registry=registry)


def test_bad_model_paths(tmp_path, registry) -> None:
    from minisgl.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"), registry=registry)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        LLM(str(tmp_path), registry=registry)


def test_two_engines_in_one_process_are_independent(make_llm) -> None:
    a, b = make_llm(), make_llm(page_size=1)
    prompts = random_prompts([9, 21], 512, seed=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out_a = [o.token_ids for o in a.generate(prompts, params)]
    out_b = [o.token_ids for o in b.generate(prompts, params)]
    assert out_a == out_b
