"""Soak: 500 random requests, a fifth aborted mid-way, a cache small enough to preempt often. Every
request that is deterministic (greedy, seeded or beam search) must give the tokens it gives on a roomy engine."""

from __future__ import annotations

import random

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams

WORDS = "the a of memory block page cache token attention key value swap copy write share".split()


def random_request(rng: random.Random):
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    kind = rng.random()
    if kind < 0.1:
        params = SamplingParams(beam_width=2, n=rng.choice([1, 2]), temperature=0, max_tokens=rng.randint(1, 12))
    else:
        n = rng.choice([1, 1, 1, 2, 3])
        params = SamplingParams(
            n=n, temperature=rng.choice([0.0, 0.7, 1.0]) if n == 1 else 0.8, top_p=rng.choice([1.0, 0.9]),
            max_tokens=rng.randint(1, 24), ignore_eos=True, seed=rng.choice([None, rng.randint(0, 10**6)]),
            stop=rng.choice([None, None, ["xyz"], [" memory", " cache"]]))
    return prompt, params


def check_finished(out, params: SamplingParams) -> None:
    assert out.error is None and out.finished
    assert len(out.outputs) == params.n
    for c in out.outputs:
        if params.use_beam_search:
            assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= params.max_tokens
        elif c.finish_reason == "length":
            assert len(c.token_ids) == params.max_tokens
        else:
            assert c.finish_reason == "stop" and c.stop_reason in params.stop_strings
            assert c.stop_reason not in c.text and len(c.token_ids) <= params.max_tokens


def test_soak_with_aborts_and_both_preemption_kinds():
    rng = random.Random(2024)
    model, tok = get_model("tiny-llama")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=48, block_size=8, max_num_seqs=32,
                       max_num_batched_tokens=256, num_swap_blocks=16)   # a host pool that fills: both kinds
    requests = {f"r{i}": random_request(rng) for i in range(500)}
    aborts = {rid: rng.randint(0, 220) for rid in rng.sample(sorted(requests), 100)}
    pending = list(requests)
    results, aborted, step = {}, set(), 0
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randint(0, 12))):
            rid = pending.pop(0)
            engine.add_request(rid, *requests[rid])
        for rid, when in aborts.items():
            if when == step and rid in engine.groups:
                for out in engine.abort_request(rid):
                    assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
                aborted.add(rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
        assert step < 20000
    stats = engine.get_stats()
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0
    assert_no_leaks(engine)
    for rid, (prompt, params) in requests.items():
        if rid in aborted:
            continue
        check_finished(results[rid], params)
    assert len(aborted) > 50
    deterministic = {rid: r for rid, r in requests.items()
                     if rid not in aborted and (r[1].temperature == 0 or r[1].seed is not None)}
    roomy = LLMEngine(model, tokenizer=tok, num_blocks=4096, block_size=8, max_num_seqs=256,
                      max_num_batched_tokens=4096)
    for rid, (prompt, params) in deterministic.items():
        roomy.add_request(rid, prompt, params)
    expected = run_to_completion(roomy)
    assert roomy.get_stats().num_preemptions == 0
    for rid in deterministic:
        assert [c.token_ids for c in results[rid].outputs] == [c.token_ids for c in expected[rid].outputs], rid
    assert len(deterministic) > 150
