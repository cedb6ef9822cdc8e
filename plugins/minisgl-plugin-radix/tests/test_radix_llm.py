"""End to end through ``minisgl.LLM``: the radix cache changes what is computed, never what is generated."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.models import random_prompts

VOCAB = 512
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _aligned(n: int, page_size: int) -> int:
    return n // page_size * page_size


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    out = llm.generate(prompts, params, use_tqdm=False)
    llm.check_accounting()
    return [o.token_ids for o in out]


def test_radix_is_the_default_when_installed(tiny_dir, registry, core_only_registry) -> None:
    assert LLM(str(tiny_dir), registry=registry, num_pages=8).engine.prefix_cache_spec.name == "radix"
    assert LLM(str(tiny_dir), registry=core_only_registry, num_pages=8).engine.prefix_cache_spec.name == "naive"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_turn_conversation_matches_naive_and_reuses_history(make_llm, page_size: int, kv_cache_dtype) -> None:
    """Also over an FP8 KV cache: the reused history is read back from its quantized pages."""
    turns = random_prompts([30, 7, 19, 4], VOCAB, seed=11)
    outputs: dict[str, list[list[int]]] = {}
    for cache in ("naive", "radix"):
        llm = make_llm(
            prefix_cache=cache, page_size=page_size, num_pages=1 + 512 // page_size, kv_cache_dtype=kv_cache_dtype
        )
        history: list[int] = []
        outputs[cache] = []
        for user in turns:
            prompt = history + user
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            llm.check_accounting()
            if cache == "radix" and history:
                # The previous turn's prompt and answer are cached up to its last computed page.
                assert out.cached_tokens == _aligned(len(history) - 1, page_size)
            if cache == "naive":
                assert out.cached_tokens == 0
            outputs[cache].append(out.token_ids)
            history = prompt + out.token_ids
    assert outputs["radix"] == outputs["naive"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_system_prompt_over_20_requests(make_llm, page_size: int) -> None:
    system = random_prompts([100], VOCAB, seed=12)[0]
    prompts = [system + q for q in random_prompts([3 + i % 7 for i in range(20)], VOCAB, seed=13)]
    results = {}
    for cache in ("naive", "radix"):
        llm = make_llm(
            prefix_cache=cache, page_size=page_size, num_pages=1 + 4096 // page_size, chunked_prefill_size=128
        )
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.check_accounting()
        results[cache] = (out, dict(llm.scheduler.stats))
    (naive, naive_stats), (radix, radix_stats) = results["naive"], results["radix"]
    assert [o.token_ids for o in radix] == [o.token_ids for o in naive]
    total = sum(len(p) for p in prompts)
    assert naive_stats["computed_prompt_tokens"] == total and naive_stats["cached_prompt_tokens"] == 0
    assert radix_stats["computed_prompt_tokens"] + radix_stats["cached_prompt_tokens"] == total
    # Only the first request computes the system prompt: the others, queued at the same time, wait
    # a step for it instead of computing it alongside, then share it while it is still running.
    shared = [o.cached_tokens for o in radix if o.cached_tokens >= _aligned(len(system), page_size)]
    assert len(shared) == len(prompts) - 1, [o.cached_tokens for o in radix]
    assert radix[0].cached_tokens == 0
    assert radix_stats["cached_prompt_tokens"] == sum(o.cached_tokens for o in radix)


@pytest.mark.parametrize("page_size", [1, 16])
def test_small_pool_forces_eviction_and_outputs_still_match(make_llm, page_size: int) -> None:
    system = random_prompts([48], VOCAB, seed=14)[0]
    shared = [system + q for q in random_prompts([5, 13, 21, 9], VOCAB, seed=15)]
    distinct = random_prompts([60, 40, 70, 33], VOCAB, seed=16)
    prompts = [p for pair in zip(shared, distinct, strict=True) for p in pair]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    num_pages = 1 + 192 // page_size  # room for about two requests at a time
    results = {}
    for cache in ("naive", "radix"):
        llm = make_llm(prefix_cache=cache, page_size=page_size, num_pages=num_pages, max_running_requests=4)
        kv = llm.scheduler.kv
        evicted: list[int] = []
        evict = kv.cache.evict

        def counting_evict(num_tokens: int, evict=evict, evicted=evicted):  # type: ignore[no-untyped-def]
            freed = evict(num_tokens)
            evicted.append(freed.numel())
            return freed

        kv.cache.evict = counting_evict  # type: ignore[method-assign]
        tokens = []
        # Two rounds: the second finds some prefixes cached and others evicted.
        for _ in range(2):
            sched = llm.scheduler
            reqs = [sched.add_request(p, params) for p in prompts]
            while sched.has_work:
                sched.step()
                llm.check_accounting()
                assert kv.used_pages <= kv.usable_pages
            tokens.append([r.output_ids for r in reqs])
        results[cache] = (tokens, sum(evicted))
    assert results["radix"][0] == results["naive"][0]
    assert results["radix"][1] > 0, "the pool was meant to be small enough to force eviction"


def test_second_request_over_shared_200_token_prefix_is_cached(make_llm) -> None:
    prefix = random_prompts([200], VOCAB, seed=17)[0]
    a, b = (prefix + q for q in random_prompts([10, 12], VOCAB, seed=18))
    llm = make_llm(prefix_cache="radix", page_size=16, num_pages=64)
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    second = llm.generate([b], GREEDY, use_tqdm=False)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens >= 192
    assert llm.scheduler.stats["cached_prompt_tokens"] == second.cached_tokens


def test_full_cache_does_not_block_a_request_that_fits_after_eviction(make_llm) -> None:
    llm = make_llm(prefix_cache="radix", page_size=4, num_pages=1 + 40)
    kv = llm.scheduler.kv
    for p in random_prompts([60, 60], VOCAB, seed=19):
        _run(llm, [p])
    assert kv.free_pages < 20 and kv.cache_pages > 20  # the cache holds most of the pool, unlocked
    big = random_prompts([100], VOCAB, seed=20)[0]
    out = llm.generate([big], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 60  # 160 tokens = the whole pool: admitted by evicting the cache


def test_abort_and_errors_unlock_the_matched_prefix(make_llm) -> None:
    llm = make_llm(prefix_cache="radix", page_size=4, chunked_prefill_size=8)
    kv, sched = llm.scheduler.kv, llm.scheduler
    prefix = random_prompts([40], VOCAB, seed=21)[0]
    _run(llm, [prefix + [7, 8]])
    cached = kv.cache.evictable_size
    assert cached > 0 and kv.cache.protected_size == 0

    # Abort mid-prefill: the request held a lock on the matched prefix; release drops it.
    req = sched.add_request(prefix + random_prompts([30], VOCAB, seed=22)[0], GREEDY)
    sched.step()
    assert req.prefix_len == 40 and kv.cache.protected_size >= 40
    sched.abort(req.rid)
    assert kv.cache.protected_size == 0
    llm.check_accounting()

    # An engine error during generate aborts every request, which unlocks their prefixes too.
    launch = llm.engine.launch
    calls = {"n": 0}

    def failing_launch(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return launch(*args, **kwargs)

    llm.engine.launch = failing_launch  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate([prefix + [9] * 20, prefix + [5] * 20], GREEDY, use_tqdm=False)
    assert kv.cache.protected_size == 0
    llm.check_accounting()
    llm.engine.launch = launch  # type: ignore[method-assign]
