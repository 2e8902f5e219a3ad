"""Regressions under memory pressure: each case once returned wrong tokens, refused a request that fits,
or never finished (issue 13). Every test bounds the number of steps and checks that no block leaks."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLM, LLMEngine, SamplingParams
from paged_backend.core.block_manager import BlockManager
from paged_backend.config import SchedulerConfig
from paged_backend.sampling_params import SamplingParams as Params
from paged_backend.core.sequence import SequenceGroup, SequenceStatus

MAX_STEPS = 2000



def alone(model, tok, prompt, params, **options):
    """The request's outputs on a roomy engine with nothing else running."""
    options.setdefault("num_blocks", 256)
    engine = LLMEngine(model, tokenizer=tok, **options)
    engine.add_request("alone", prompt, params)
    out = run_to_completion(engine, MAX_STEPS)["alone"]
    assert out.error is None
    return [c.token_ids for c in out.outputs]


def hf_beam_tokens(model, prompt, k, max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, do_sample=False,
                         max_new_tokens=max_tokens, pad_token_id=2)
    row = out[0, len(prompt):].tolist()
    return row[: row.index(2) + 1] if 2 in row else row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swapping_out_two_requests_that_share_cached_blocks_in_one_step(dtype):
    """Both requests hold the same two prefix-cached blocks; one step swaps both out. The shared device blocks
    must be copied to the host once and shared there, or one request resumes on stale memory."""
    model, tok = get_model("tiny-llama", dtype)
    bs = 8
    prefix = list(range(100, 100 + 2 * bs))
    prompts = {"a": prefix + [5, 6, 7], "b": prefix + [9, 10]}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=17, block_size=bs, enable_prefix_caching=True,
                       preemption_mode="swap", num_swap_blocks=64)
    swapped_together = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        if {"a", "b"} <= {g.request_id for g in out.preempted}:
            swapped_together.append(out)
        return out

    engine.scheduler.schedule = spy
    engine.add_request("a", prompts["a"], greedy, arrival_time=1.0)
    engine.step()
    engine.add_request("b", prompts["b"], greedy, arrival_time=2.0)
    engine.step()
    engine.add_request("old", list(range(300, 308)), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=30,
                                                                    ignore_eos=True), arrival_time=0.0)
    outs = run_to_completion(engine, MAX_STEPS)
    assert swapped_together, "the scenario must swap both requests out in one step"
    assert engine.get_stats().prefix_cache_hits >= 2
    for rid in "ab":
        assert [c.token_ids for c in outs[rid].outputs] == alone(model, tok, prompts[rid], greedy), rid
    assert outs["old"].error is None
    assert_no_leaks(engine)


def test_shared_device_block_is_swapped_out_once_to_one_shared_host_block():
    bm = BlockManager(block_size=4, num_blocks=8, num_swap_blocks=8, enable_prefix_caching=True)
    groups = []
    for tail in ([50], [60, 61]):
        group = SequenceGroup(f"g{len(groups)}", None, list(range(8)) + tail, Params(temperature=0))
        bm.allocate(group)
        group.set_status(SequenceStatus.RUNNING)
        seq = group.seqs[0]
        seq.num_computed_tokens = len(seq)
        bm.mark_computed(seq)
        groups.append(group)
    shared = bm.block_tables[groups[0].seqs[0].seq_id][:2]
    assert shared == bm.block_tables[groups[1].seqs[0].seq_id][:2]
    mapping = {}
    for group in groups:
        bm.swap_out(group, mapping)
        group.set_status(SequenceStatus.SWAPPED)
    host_tables = [bm.swapped_tables[g.seqs[0].seq_id] for g in groups]
    assert host_tables[0][:2] == host_tables[1][:2]
    assert [bm.host.ref_counts[b] for b in host_tables[0][:2]] == [2, 2]
    assert len(mapping) == 4 and len(set(mapping.values())) == 4  # 2 shared + one tail block per request
    assert bm.get_num_free_swap_blocks() == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recomputing_beams_with_chunked_prefill(dtype):
    """A 2-beam request preempted by recomputation while prompts are chunked: the beams must come back
    with identical K/V for their shared prompt and end as transformers' beam search does."""
    model, tok = get_model("tiny-llama", dtype)
    prompt = list(range(1000, 1070))
    params = SamplingParams(beam_width=2, temperature=0, max_tokens=16)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=14, block_size=16, max_num_batched_tokens=32,
                       max_num_seqs=8, preemption_mode="recompute")
    engine.add_request("beam", prompt, params, arrival_time=1.0)
    for _ in range(4):
        engine.step()
    engine.add_request("old", list(range(2000, 2096)), SamplingParams(temperature=0, max_tokens=20,
                                                                      ignore_eos=True), arrival_time=0.0)
    outs = run_to_completion(engine, MAX_STEPS)
    assert engine.get_stats().num_recompute_preemptions > 0
    assert outs["beam"].error is None and outs["old"].error is None
    if dtype == torch.float64:
        assert outs["beam"].outputs[0].token_ids == hf_beam_tokens(model, prompt, 2, 16)
    else:
        assert [c.token_ids for c in outs["beam"].outputs] == alone(model, tok, prompt, params)
    assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_recomputed_samples_match_the_request_alone(mode):
    """n=3 seeded samples preempted mid-generation, with chunked prefill: same tokens as alone."""
    model, tok = get_model("tiny-llama", torch.float32)
    prompt = list(range(700, 745))
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=20, block_size=8, max_num_batched_tokens=16,
                       max_num_seqs=8, preemption_mode=mode, num_swap_blocks=32)
    engine.add_request("samples", prompt, params, arrival_time=1.0)
    for _ in range(8):
        engine.step()
    group = engine.groups["samples"]
    assert len(group.seqs) == 3
    engine.add_request("old", list(range(2000, 2050)), SamplingParams(temperature=0, max_tokens=30,
                                                                      ignore_eos=True), arrival_time=0.0)
    outs = run_to_completion(engine, MAX_STEPS)
    assert group.num_preemptions > 0
    assert [c.token_ids for c in outs["samples"].outputs] == alone(model, tok, prompt, params)
    assert_no_leaks(engine)


def _swap_scenario(b_max_tokens: int):
    """An older 1-token request grows while a 2-sample request of 26 prompt tokens fills the rest of an
    8-block cache, so the 2-sample request is swapped out holding nearly every block."""
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=8, block_size=8, preemption_mode="swap", num_swap_blocks=16)
    engine.add_request("a", [500], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), arrival_time=0.0)
    prompt = list(range(600, 626))
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=b_max_tokens, ignore_eos=True)
    engine.add_request("b", prompt, params, arrival_time=1.0)
    return model, tok, engine, prompt, params


def test_swapped_request_that_needs_the_whole_cache_comes_back():
    """Swapped out holding 6 of 8 blocks, it needs 7 at the end: it must come back once the older request
    is done, instead of waiting forever for one more block per sequence than it needs."""
    model, tok, engine, prompt, params = _swap_scenario(b_max_tokens=12)
    outs = run_to_completion(engine, max_steps=200)
    assert engine.get_stats().num_swap_preemptions > 0
    assert outs["b"].error is None
    assert [c.token_ids for c in outs["b"].outputs] == alone(model, tok, prompt, params, block_size=8)
    assert_no_leaks(engine)


def test_request_that_can_never_fit_fails_instead_of_spinning():
    """The same request wanting 20 tokens per sample needs 9 blocks of an 8-block cache: once it is alone
    it fails with a clear error (the engine once spun forever with it swapped out)."""
    model, tok, engine, prompt, params = _swap_scenario(b_max_tokens=20)
    outs = run_to_completion(engine, max_steps=200)
    assert outs["a"].error is None and len(outs["a"].outputs[0].token_ids) == 12
    assert outs["b"].error is not None and "KV blocks" in outs["b"].error
    assert_no_leaks(engine)


def test_copy_on_write_counts_one_copy_for_the_last_holder():
    """n=2 on a 110-token prompt with 8 blocks of 16: the two samples share 7 blocks, and writing the
    shared last block copies it once (the last holder keeps the original): 8 blocks, it fits."""
    model, tok = get_model("tiny-llama", torch.float32)
    prompt = list(range(500, 610))
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, ignore_eos=True)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=8, block_size=16)
    engine.add_request("a", prompt, params)
    out = run_to_completion(engine, MAX_STEPS)["a"]
    assert out.error is None
    assert [c.token_ids for c in out.outputs] == alone(model, tok, prompt, params, block_size=16)
    assert engine.get_stats().num_preemptions == 0
    assert_no_leaks(engine)


def test_block_count_to_append_is_exact():
    bm = BlockManager(block_size=4, num_blocks=16)
    group = SequenceGroup("g", None, [1, 2, 3, 4, 5, 6], Params(n=3, temperature=1.0))
    bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)
    parent = group.seqs[0]
    parent.num_computed_tokens = 6
    for _ in range(2):
        child = parent.fork()
        bm.fork(parent, child)
        group.seqs.append(child)
    for seq in group.seqs:
        seq.append_token(7, 0.0)
    # Three holders write into the shared second block: two copies, the last holder keeps it.
    assert bm.num_blocks_to_append(group.seqs) == 2
    free = bm.get_num_free_blocks()
    copies = [pair for seq in group.seqs for pair in bm.append_slots(seq)]
    assert len(copies) == 2 and bm.get_num_free_blocks() == free - 2


def test_token_budget_must_cover_the_sequence_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    assert SchedulerConfig(max_num_batched_tokens=4).max_num_seqs == 4  # the default follows a small budget


def test_request_wider_than_the_token_budget_is_refused_not_starved():
    model, tok = get_model("tiny-llama", torch.float32)
    llm = LLM(model, tokenizer=tok, num_blocks=64, block_size=8, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate(["Hello there"], SamplingParams(beam_width=4, temperature=0, max_tokens=4), use_tqdm=False)
    out = llm.generate(["Hello there"], SamplingParams(beam_width=3, temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert_no_leaks(llm.engine)


def test_every_running_decode_sequence_is_scheduled_each_step():
    """Decode tokens never exceed the budget (it covers max_num_seqs), so no running request is skipped."""
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, max_num_batched_tokens=6)
    engine.add_request("one", [5, 6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("beams", [7, 8, 9], SamplingParams(beam_width=4, temperature=0, max_tokens=6))
    engine.add_request("two", [10], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    schedule = engine.scheduler.schedule

    def check():
        out = schedule()
        running = sum(len(g.get_seqs(SequenceStatus.RUNNING)) for g in engine.scheduler.running)
        decoding = [s for s in out.scheduled if s.num_tokens == 1]
        assert len(out.scheduled) == running or any(s.num_tokens > 1 for s in out.scheduled), out
        assert len(decoding) <= 6
        return out

    engine.scheduler.schedule = check
    outs = run_to_completion(engine, max_steps=40)
    assert all(o.error is None for o in outs.values())


def test_freed_prefix_chains_are_evicted_from_the_tail():
    """A freed 4-block prompt parks its blocks tail first, so LRU eviction takes the chain's end and a
    re-sent prompt still hits the first three blocks."""
    bm = BlockManager(block_size=4, num_blocks=6, watermark=0.0, enable_prefix_caching=True)
    tokens = list(range(17))
    first = SequenceGroup("first", None, tokens, Params(temperature=0))
    bm.allocate(first)
    seq = first.seqs[0]
    seq.num_computed_tokens = len(seq)
    bm.mark_computed(seq)
    bm.free(seq)
    other = SequenceGroup("other", None, list(range(100, 111)), Params(temperature=0))
    bm.allocate(other)  # 3 blocks: 2 from the free list, 1 evicted from the cache
    assert bm.prefix_cache.num_evictions == 1
    bm.free(other.seqs[0])
    again = SequenceGroup("again", None, tokens, Params(temperature=0))
    bm.allocate(again)
    assert again.seqs[0].num_computed_tokens == 3 * 4


def _single_sequence_pressure(swap_single=None, **options):
    """Two greedy one-sequence requests that cannot both grow in 6 blocks of 8: the newer one is preempted.
    `swap_single` False: the scheduler's default on other devices than the CPU."""
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=6, block_size=8, **options)
    assert engine.scheduler.swap_single   # the engine's device is the CPU
    if swap_single is not None:
        engine.scheduler.swap_single = swap_single
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, start in enumerate((800, 900)):
        engine.add_request(f"r{i}", list(range(start, start + 12)), params, arrival_time=float(i))
    outs = run_to_completion(engine, MAX_STEPS)
    for i, start in enumerate((800, 900)):
        assert [c.token_ids for c in outs[f"r{i}"].outputs] == alone(model, tok, list(range(start, start + 12)), params)
    assert_no_leaks(engine)
    return engine.get_stats()


def test_on_a_cpu_device_one_sequence_requests_are_swapped_by_default_and_recomputed_without_host_blocks():
    """Without a preemption_mode a CPU engine swaps one-sequence requests too (copying blocks within the same
    memory costs far less than recomputing them), and recomputes them where it has no host pool; the scheduler's
    default for other devices keeps vLLM's, recomputation."""
    swapped = _single_sequence_pressure(num_swap_blocks=8)
    assert swapped.num_swap_preemptions > 0 and swapped.num_recompute_preemptions == 0
    recomputed = _single_sequence_pressure(num_swap_blocks=0)
    assert recomputed.num_recompute_preemptions > 0 and recomputed.num_swap_preemptions == 0
    pinned = _single_sequence_pressure(num_swap_blocks=8, preemption_mode="recompute")
    assert pinned.num_recompute_preemptions > 0 and pinned.num_swap_preemptions == 0
    elsewhere = _single_sequence_pressure(swap_single=False, num_swap_blocks=8)
    assert elsewhere.num_recompute_preemptions > 0 and elsewhere.num_swap_preemptions == 0
