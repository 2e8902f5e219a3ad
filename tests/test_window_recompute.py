"""Recomputation of sliding-window sequences (issue 20, cases 6 and 9): a windowed sequence that is readmitted
after a recompute preemption needs only the blocks of its window, never a block per token, so a request the
intake accepted is never refused later; and its readmission reuses its cached window blocks even when the
blocks behind the window were evicted."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaks, get_model, hf_greedy_tokens, run_to_completion
from paged_backend import LLMEngine, SamplingParams
from paged_backend.core.block_manager import HOLE, AllocStatus, BlockManager
from paged_backend.config import SchedulerConfig
from paged_backend.sampling_params import SamplingParams as Params
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import SequenceGroup, SequenceStatus

WINDOW = 8
MAX_STEPS = 1000


def alone(model, tok, prompt, params):
    engine = LLMEngine(model, tokenizer=tok, num_blocks=256, block_size=4)
    engine.add_request("alone", prompt, params)
    out = run_to_completion(engine, MAX_STEPS)["alone"]
    assert out.error is None
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_long_windowed_request_survives_recompute_preemption(dtype, prefix_caching):
    """A 6-block cache; a greedy request generates 60 tokens (16 blocks' worth). An earlier-arrived request with
    two samples joins when it is about 50 tokens long and preempts it by recomputation; readmitted, it must
    get only its window's blocks, finish with transformers' tokens and leave every block free."""
    model, tok = get_model("tiny-mistral", dtype)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=6, block_size=4, preemption_mode="recompute",
                       max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    assert engine.sliding_window == WINDOW
    long_prompt = tok("Hello there my friend").input_ids
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("long", long_prompt, greedy, arrival_time=10.0)
    finals = {}
    for _ in range(45):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    early_prompt = tok("Paged attention splits memory into blocks of tokens").input_ids
    samples = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    engine.add_request("early", early_prompt, samples, arrival_time=0.0)
    finals.update(run_to_completion(engine, MAX_STEPS))
    stats = engine.get_stats()
    assert stats.num_recompute_preemptions > 0
    assert finals["long"].error is None, finals["long"].error
    assert finals["long"].outputs[0].token_ids == hf_greedy_tokens(model, long_prompt, 60)
    assert [c.token_ids for c in finals["early"].outputs] == alone(model, tok, early_prompt, samples)
    assert_no_leaks(engine)


def windowed_group(length: int, n: int = 1, first_token: int = 0) -> SequenceGroup:
    tokens = list(range(first_token, first_token + length))
    return SequenceGroup(f"w{first_token}-{length}-{n}", None, tokens, Params(n=n, temperature=1.0))


def step(scheduler: Scheduler) -> list:
    """Schedule one step and mark its chunks computed, as the engine does (no model: nothing is sampled)."""
    out = scheduler.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        scheduler.block_manager.mark_computed(item.seq)
        scheduler.block_manager.release_out_of_window(item.seq)
    return out.scheduled


def test_readmission_of_a_windowed_sequence_waits_only_for_its_window():
    """A recomputed 51-token windowed sequence asks for the blocks its window needs, not 13: it is readmitted
    while another request holds most of a 6-block cache (it never blocks the queue's head for blocks it does
    not need, and is never refused as too long for the cache), and recomputes chunk by chunk in the blocks
    left free, releasing those behind its window."""
    bm = BlockManager(block_size=4, num_blocks=6, sliding_window=WINDOW)
    assert bm.can_allocate(windowed_group(51)) == AllocStatus.OK
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), bm)
    other = windowed_group(17, first_token=100)
    scheduler.add(other)
    while other.seqs[0].num_uncomputed_tokens > 0:
        step(scheduler)
    assert bm.num_held_blocks(other.seqs[0]) == 3  # its window: 3 blocks held, 3 free
    group = windowed_group(51)
    group.num_preemptions = 1  # as after a recompute preemption: waiting with every token to compute again
    scheduler.add(group)
    seq = group.seqs[0]
    most, steps = 0, 0
    while seq.num_uncomputed_tokens > 0:
        scheduled = step(scheduler)
        assert any(item.seq is seq for item in scheduled), "the readmitted request must run beside the other"
        assert not group.is_finished()
        most = max(most, bm.num_held_blocks(seq))
        steps += 1
        assert steps < 60
    assert most <= 3 and steps > 1
    assert bm.num_held_blocks(seq) <= 3
    for g in (other, group):
        scheduler.finish_group(g, SequenceStatus.FINISHED_ABORTED)
    assert bm.get_num_free_blocks() == 6


def test_windowed_readmission_reuses_its_window_after_the_head_is_evicted():
    """A windowed sequence's blocks behind its window were released (and parked) long before it was preempted,
    so they are the first a newer request's prefill evicts. The readmitted sequence must still find its cached
    window blocks: it starts computing after them, with holes behind, instead of recomputing every token."""
    bm = BlockManager(block_size=4, num_blocks=10, sliding_window=WINDOW, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4), bm)
    group = windowed_group(25)
    seq = group.seqs[0]
    scheduler.add(group)
    while seq.num_uncomputed_tokens:  # 4 tokens a step
        step(scheduler)
    assert bm.num_held_blocks(seq) == 3
    other = windowed_group(20, first_token=1000)  # its prefill takes the free blocks and the two oldest parked
    scheduler.add(other)
    while other.seqs[0].num_uncomputed_tokens:
        step(scheduler)
    cache = bm.prefix_cache
    hashes = list(seq.block_hashes)
    assert [cache.hash_to_block.get(h) is None for h in hashes] == [True, True] + [False] * 4
    scheduler._preempt(group, SchedulerOutput())  # by recomputation, as when an older request needs its blocks
    scheduler.running.remove(group)
    hits_before = cache.num_hits
    out = scheduler.schedule()
    assert [item.seq for item in out.scheduled] == [seq]
    assert seq.num_computed_tokens == 24  # all 6 full blocks skipped (the last token is always computed)
    table = bm.block_tables[seq.seq_id]
    assert table[:4] == [HOLE] * 4 and HOLE not in table[4:]
    assert cache.num_hits - hits_before == 6
    assert bm.num_held_blocks(seq) == 3
    for g in (other, group):
        scheduler.finish_group(g, SequenceStatus.FINISHED_ABORTED)
    assert bm.get_num_free_blocks() == 10


def run_windowed_under_pressure(model, tok, requests, mode):
    """The differential stress workload on a windowed model: blocks of 4 (a window spans three), a cache that
    holds the longest prompt but not the workload, prefills chunked by an 8-token budget."""
    from test_stress_differential import run_workload  # here: imported at the top, its tests would run twice

    engine = LLMEngine(model, tokenizer=tok, block_size=4, num_blocks=14, num_swap_blocks=16,
                       enable_prefix_caching=True, max_num_batched_tokens=8, preemption_mode=mode)
    return engine, run_workload(engine, requests)


@pytest.mark.parametrize("mode", ["recompute", None], ids=["recompute", "mixed"])
def test_windowed_stress_differential(window_seed, mode, dtype):
    """The differential stress test's random workloads (shared prefixes, greedy, seeded samples, beams, arrivals
    over several steps) on tiny-mistral under recomputation: greedy and beams equal transformers' generate,
    seeded samples the request alone; nothing fails, nothing leaks."""
    from test_stress_differential import check_outputs, random_workload

    model, tok = get_model("tiny-mistral", dtype)
    requests = random_workload(window_seed)
    engine, finals = run_windowed_under_pressure(model, tok, requests, mode)
    stats = engine.get_stats()
    assert (stats.num_recompute_preemptions if mode == "recompute" else stats.num_preemptions) > 0, stats
    assert_no_leaks(engine)
    check_outputs(model, tok, requests, finals, dtype, window_seed)


def pytest_generate_tests(metafunc):
    """One workload by default; `pytest --stress-seeds=N` runs N // 3 of them (the tiny-llama test runs N)."""
    if "window_seed" in metafunc.fixturenames:
        count = max(1, metafunc.config.getoption("stress_seeds") // 3)
        metafunc.parametrize("window_seed", list(range(count)))
