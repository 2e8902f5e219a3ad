"""Admission after a preemption (SchedulerConfig.admission_backoff_steps): on demand until the running requests
outgrow the cache, then a new request must leave room for them to grow, a caution that fades step by step."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams
from paged_backend.config import SchedulerConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import SequenceGroup, SequenceStatus
from paged_backend.sampling_params import SamplingParams as Params

MAX_STEPS = 2000


def _cohort(engine, count: int = 16, prompt_len: int = 8, max_tokens: int = 8) -> dict:
    """`count` greedy requests of `prompt_len` tokens, all waiting at once, each growing by `max_tokens`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(count):
        engine.add_request(f"r{i}", list(range(300 + 40 * i, 300 + 40 * i + prompt_len)), params, arrival_time=float(i))
    return run_to_completion(engine, MAX_STEPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_after_a_preemption_new_requests_wait_for_room_to_grow(dtype):
    """Sixteen requests of 2 blocks that each grow to 4, in 12 blocks: on demand the scheduler admits six and
    preempts again each time it refills the cache with prompts (10 preemptions); backing off, it preempts in the
    first wave and then mostly admits what can grow (3). Tokens are the same either way, and no block is held at
    the end."""
    model, tok = get_model("tiny-llama", dtype)
    runs = {}
    for steps in (0, 512):
        engine = LLMEngine(model, tokenizer=tok, num_blocks=12, block_size=4, num_swap_blocks=0,
                           admission_backoff_steps=steps)
        outs = _cohort(engine)
        runs[steps] = ({rid: out.outputs[0].token_ids for rid, out in outs.items()},
                       engine.get_stats().num_preemptions)
        assert all(out.error is None for out in outs.values())
        assert_no_leaks(engine)
    (on_demand, on_demand_preemptions), (backing_off, backing_off_preemptions) = runs[0], runs[512]
    assert backing_off == on_demand
    assert 1 <= backing_off_preemptions < on_demand_preemptions, runs


def _scheduler(num_blocks: int, backoff_steps=4) -> Scheduler:
    bm = BlockManager(block_size=4, num_blocks=num_blocks)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, admission_backoff_steps=backoff_steps), bm)


def _group(name: str, prompt_len: int, max_tokens: int, first: int = 0) -> SequenceGroup:
    group = SequenceGroup(name, None, list(range(first, first + prompt_len)), Params(temperature=0))
    group.seqs[0].max_len = prompt_len + max_tokens   # what the engine sets from max_tokens and the context
    return group


def test_the_reserve_counts_each_running_sequences_remaining_tokens_times_the_share():
    """A running sequence of 5 tokens that may reach 21 keeps 4 more blocks of 4 at share 1 (to 21 tokens: 6
    blocks, 2 held), 2 at share 0.5 (to 13: 4 blocks), none at 0; one already at its limit keeps none."""
    scheduler = _scheduler(num_blocks=32)
    growing, done = _group("a", 5, 16), _group("b", 8, 0, first=50)
    for share, blocks in ((1.0, 4), (0.5, 2), (0.0, 0)):
        scheduler.growth_share = share
        assert scheduler._growth_blocks([growing.seqs[0], done.seqs[0]]) == blocks


def _share_after_a_preemption(backoff_steps) -> float:
    """The growth share of a scheduler whose only running request was just preempted."""
    scheduler = _scheduler(num_blocks=8, backoff_steps=backoff_steps)
    victim = _group("v", 4, 4)
    scheduler.add(victim)
    scheduler.schedule()
    scheduler.running.remove(victim)
    scheduler._preempt(victim, SchedulerOutput())
    return scheduler.growth_share


def test_a_preemption_sets_the_share_and_it_fades_over_the_configured_steps():
    """A preemption sets the share to 1; each step takes 1 / admission_backoff_steps off it until it is 0. With
    admission_backoff_steps 0 a preemption leaves admission on demand."""
    for steps, expected in ((4, 1.0), (0, 0.0)):
        assert _share_after_a_preemption(steps) == expected
    shares = []
    scheduler = _scheduler(num_blocks=8, backoff_steps=4)
    scheduler.growth_share = 1.0
    for _ in range(5):
        scheduler.schedule()
        shares.append(scheduler.growth_share)
    assert shares == [0.75, 0.5, 0.25, 0.0, 0.0]


def test_a_waiting_request_runs_once_the_running_ones_leave_it_room_and_never_waits_on_an_empty_cache():
    """While the share is 1, a request that fits on demand waits for a running one that may still grow into the
    blocks it would take; it is admitted when that one ends. A request alone is admitted whatever its own limit
    (no reserve applies with nothing running, so backing off never stalls the queue)."""
    scheduler = _scheduler(num_blocks=12, backoff_steps=1000)
    long = _group("long", 4, 36)      # 1 block now, up to 10
    scheduler.add(long)
    scheduler.growth_share = 1.0
    assert [item.seq.seq_id for item in scheduler.schedule().scheduled] == [long.seqs[0].seq_id]
    new = _group("new", 8, 4, first=100)   # 2 blocks now (free: 11), up to 3
    scheduler.add(new)
    scheduler.schedule()
    assert scheduler.waiting[0] is new and scheduler.running == [long]
    scheduler.finish_group(long, SequenceStatus.FINISHED_STOPPED)
    scheduler.free_finished()
    scheduler.growth_share = 1.0
    assert [item.seq.seq_id for item in scheduler.schedule().scheduled] == [new.seqs[0].seq_id]
    alone = _scheduler(num_blocks=12, backoff_steps=1000)
    huge = _group("huge", 4, 1000)    # its limit is far beyond the cache: on demand it runs (and fails later)
    alone.add(huge)
    alone.growth_share = 1.0
    assert [item.seq.seq_id for item in alone.schedule().scheduled] == [huge.seqs[0].seq_id]


def test_a_cpu_engine_backs_off_by_default_and_the_option_overrides_it():
    """Unset, a CPU engine takes CPU_ADMISSION_BACKOFF_STEPS (a prompt recomputed there costs its whole prefill
    again); a scheduler built without an engine admits on demand, as vLLM's."""
    from paged_backend.config import CPU_ADMISSION_BACKOFF_STEPS

    model, tok = get_model("tiny-llama", torch.float32)
    assert LLMEngine(model, tokenizer=tok, num_blocks=8).config.scheduler.admission_backoff_steps == \
        CPU_ADMISSION_BACKOFF_STEPS == 512
    assert LLMEngine(model, tokenizer=tok, num_blocks=8, admission_backoff_steps=7).scheduler.config \
        .admission_backoff_steps == 7
    assert _share_after_a_preemption(None) == 0.0


def test_admission_backoff_steps_must_be_a_non_negative_integer():
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="admission_backoff_steps"):
            SchedulerConfig(admission_backoff_steps=bad)
