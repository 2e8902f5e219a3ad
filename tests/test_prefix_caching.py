"""Shared prompt prefixes across requests reuse cached KV blocks without changing any output."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaks, get_model
from paged_backend import LLM, SamplingParams

BLOCK = 8
QUESTIONS = ["Who?", "Why not?", "When?", "Where to?", "How?"]


def system_prompt_ids(tok, blocks: int = 6):
    text = ("You are a careful assistant. Translate English to French. sea otter => loutre de mer. "
            "cheese => fromage. peppermint => menthe poivrée. plush giraffe => girafe peluche. ") * 3
    return tok(text).input_ids[: blocks * BLOCK]


def prompts_with_shared_prefix(tok):
    prefix = system_prompt_ids(tok)
    prompts = [prefix + tok(q).input_ids for q in QUESTIONS]
    assert all(0 < len(p) - len(prefix) < BLOCK for p in prompts)  # the questions add no full block
    return prefix, prompts


def make_llm(caching: bool, **options):
    model, tok = get_model("tiny-llama")
    options.setdefault("num_blocks", 128)
    return LLM(model, tokenizer=tok, block_size=BLOCK, enable_prefix_caching=caching, **options)


def run(llm, prompts, params):
    """The first request alone (it fills the cache), then the rest together."""
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in first + rest]


def test_shared_system_prompt_hits_the_cache_and_changes_nothing():
    _, tok = get_model("tiny-llama")
    prefix, prompts = prompts_with_shared_prefix(tok)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain, cached = make_llm(False), make_llm(True)
    assert run(cached, prompts, params) == run(plain, prompts, params)
    stats, base = cached.get_stats(), plain.get_stats()
    n = len(prompts)
    assert stats.prefix_cache_hit_rate >= (n - 1) / n
    assert stats.prefix_cache_hits == (n - 1) * (len(prefix) // BLOCK)
    assert stats.num_cached_prefill_tokens == (n - 1) * len(prefix)
    assert stats.num_prompt_tokens == base.num_prompt_tokens - (n - 1) * len(prefix)
    assert_no_leaks(cached.engine)


@pytest.mark.parametrize("params", [
    SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=12),
    SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
], ids=["beams", "samples"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefix_caching_with_beams_samples_and_preemption(params, mode):
    _, tok = get_model("tiny-llama")
    _, prompts = prompts_with_shared_prefix(tok)
    expected = run(make_llm(False), prompts, params)
    small = make_llm(True, num_blocks=24, preemption_mode=mode)
    everything = small.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in everything] == expected
    stats = small.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_no_leaks(small.engine)


def test_evicted_blocks_are_recomputed_correctly():
    """With little memory, cached blocks are evicted (LRU) and later prompts recompute them."""
    _, tok = get_model("tiny-llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [tok(f"Topic {i}: " + "memory pages " * 12).input_ids for i in range(8)]
    expected = [o.outputs[0].token_ids for o in make_llm(False).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(True, num_blocks=12)
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts + prompts[:2]]
    assert got == expected + expected[:2]
    assert llm.engine.block_manager.prefix_cache.num_evictions > 0
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
], ids=["greedy", "samples"])
def test_recomputation_reuses_the_requests_own_cached_blocks(params):
    """A request preempted by recomputation finds its computed blocks (prompt and generated tokens) in the
    cache when it comes back and recomputes only what was evicted: fewer recomputed tokens, same output."""
    _, tok = get_model("tiny-llama")
    prompts = [tok(f"Request number {i} talks about paged memory and blocks").input_ids for i in range(4)]
    runs = {}
    for caching in (False, True):
        llm = make_llm(caching, num_blocks=22, preemption_mode="recompute")
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[caching] = ([[c.token_ids for c in o.outputs] for o in outs], llm.get_stats())
        assert_no_leaks(llm.engine)
    (plain, plain_stats), (cached, cached_stats) = runs[False], runs[True]
    assert cached == plain
    assert plain_stats.num_recompute_preemptions > 0 and cached_stats.num_recompute_preemptions > 0
    assert 0 < cached_stats.num_recomputed_tokens < plain_stats.num_recomputed_tokens, (cached_stats, plain_stats)
    assert cached_stats.num_cached_prefill_tokens > 0
