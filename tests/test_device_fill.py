"""Tokens left on the device for the next step's inputs (`StepInputs.device_fill`, `PendingDraws`): on a GPU the
worker launches step N+1 without waiting for step N's tokens (greedy or sampled, one per row) to reach the host.
There is no GPU here, so the runner is told it fills on the device (`fills_on_device`): the same path with host
tensors. Every output must equal the plain engine's (no overlap), under memory pressure, with and without the
decode buckets, and a request whose row fails must leave its neighbours exactly as a run without it."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_requests
from paged_backend import LLMEngine, SamplingParams
from paged_backend.engine.llm_engine import LLMEngine as EngineClass
from paged_backend.sampling.sampler import PendingDraws, Sampler
from paged_backend.worker.cuda_graphs import GraphConfig
from paged_backend.worker.step_inputs import DeviceFill


@pytest.fixture
def counted(monkeypatch):
    """How many pending batches the sampler made (and of them sampled ones) and how many device fills runners
    applied."""
    from paged_backend import kernels

    counts = {"pending": 0, "sampled": 0, "fills": 0}
    of, nosync, apply = PendingDraws.of.__func__, kernels.sample_rows_nosync, DeviceFill.apply

    def pending(cls, marked):
        counts["pending"] += 1
        return of(cls, marked)

    def sampled(*args):
        counts["sampled"] += 1
        return nosync(*args)

    def fill(self, input_ids):
        counts["fills"] += 1
        return apply(self, input_ids)
    monkeypatch.setattr(PendingDraws, "of", classmethod(pending))
    monkeypatch.setattr(kernels, "sample_rows_nosync", sampled)
    monkeypatch.setattr(DeviceFill, "apply", fill)
    return counts


def _engine(monkeypatch, buckets: bool, on_device: bool, **options) -> LLMEngine:
    model, tokenizer = get_model("tiny-llama", options.pop("dtype", torch.float64))
    if buckets:   # the reference kernels skip padding rows' cache writes, as Triton's do (test_decode_graphs.py)
        monkeypatch.setenv("PAGED_BACKEND_KERNELS", "torch")
    monkeypatch.setattr(EngineClass, "_decode_graphs", (lambda self, lora: GraphConfig(
        self.config.scheduler.max_num_seqs, self.max_model_len, capture=False, buckets=[1, 2, 4, 8]))
        if buckets else (lambda self, lora: None))
    engine = LLMEngine(model, tokenizer=tokenizer, **options)
    engine.runner.fills_on_device = on_device
    return engine


def _workload(seed: int, plain_only: bool = False):
    """Greedy, n = 2 seeded sampling and beam requests; `plain_only`: greedy and seeded top-p requests alternating
    (every row of every step takes the device path)."""
    rng = random.Random(seed)
    work = []
    for i in range(10):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 30))]
        kind = (0 if i % 2 else 5) if plain_only else i % 5
        if kind == 5:
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=rng.randrange(8, 36),
                                    ignore_eos=True)
        elif kind in (0, 3, 4):
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(8, 36), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=rng.randrange(4, 16), ignore_eos=True)
        else:
            params = SamplingParams(beam_width=2, temperature=0, max_tokens=rng.randrange(4, 10), ignore_eos=True)
        work.append((str(i), prompt, params))
    return work


def _run(engine: LLMEngine, work) -> dict:
    finals = run_requests(engine, work, max_steps=3000)
    return {rid: ([list(c.token_ids) for c in out.outputs], out.error) for rid, out in finals.items()}


@pytest.mark.parametrize("mode, buckets, dtype", [("swap", True, torch.float64), ("recompute", False, torch.float64),
                                                  ("swap", False, torch.float32)])
def test_device_fills_give_the_plain_engines_outputs_under_pressure(monkeypatch, counted, mode, buckets, dtype):
    options = dict(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, preemption_mode=mode,
                   dtype=dtype, **({"num_swap_blocks": 64} if mode == "swap" else {}))
    work = _workload(5)
    want = _run(_engine(monkeypatch, False, False, async_scheduling=False, **options), work)
    engine = _engine(monkeypatch, buckets, True, **options)
    assert _run(engine, work) == want
    assert not [error for _, error in want.values() if error]
    assert counted["pending"] > 10 and counted["sampled"] > 3 and counted["fills"] > 5, counted   # else untaken
    assert engine.get_stats().num_preemptions > 0
    if buckets:
        assert engine.runner.graphs.stats.replays > 5
    assert_no_leaks(engine)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_row_without_a_finite_maximum_fails_its_request_alone(monkeypatch, counted, dtype):
    # request "2"'s logits row turns NaN at its 4th token: it fails ("no finite maximum"), its pending token fills
    # the next step's input with 0 (a row computed in vain), and every other request's tokens (greedy, and seeded
    # top-p draws) are a run's without it
    from paged_backend.engine.token_processor import TokenProcessor

    work = _workload(8, plain_only=True)
    options = dict(num_blocks=96, block_size=4, max_num_seqs=8, dtype=dtype)
    without = _run(_engine(monkeypatch, True, True, **options), [w for w in work if w[0] != "2"])
    sample_later = TokenProcessor.sample_later
    draws = {"2": 0}   # request "2"'s draws so far, counted here: its token count on the worker thread races the
    # processing of the previous step on the engine's (a flake under load: the 4th token's row was never poisoned)

    def poisoned(self, rows, logits):
        for i, item in enumerate(rows.samplers):
            if item.group.request_id == "2":
                draws["2"] += 1
                if draws["2"] == 4:
                    logits = logits.clone()
                    logits[i] = float("nan")
        return sample_later(self, rows, logits)
    monkeypatch.setattr(TokenProcessor, "sample_later", poisoned)
    engine = _engine(monkeypatch, True, True, **options)
    got = _run(engine, work)
    tokens, error = got.pop("2")
    assert "no finite maximum" in error and len(tokens[0]) == 3, (tokens, error)
    assert got == without
    assert counted["fills"] > 5 and counted["sampled"] > 5, counted
    assert_no_leaks(engine)


def test_the_next_step_gets_the_tokens_while_the_engine_waits_for_their_copy(monkeypatch, counted):
    # on a GPU the worker is usually done with step N before step N+1 is launched, so step N+1's job asks step N
    # for its tokens while the engine's thread waits (GIL released) for their copy to the host: the tokens must
    # be there throughout (a found bug: they were taken away for that wait, and step N+1 got zeros)
    import time

    batch = PendingDraws.batch

    def slow(self):   # an event's synchronize: the interpreter is free while the copy lands
        time.sleep(0.02)
        return batch(self)
    monkeypatch.setattr(PendingDraws, "batch", slow)
    work = _workload(11)[:5]
    options = dict(num_blocks=64, block_size=4, max_num_seqs=8)
    want = _run(_engine(monkeypatch, False, False, async_scheduling=False, **options), work)
    engine = _engine(monkeypatch, False, True, **options)
    assert _run(engine, work) == want
    assert counted["pending"] > 10, counted
    assert_no_leaks(engine)


def test_pending_greedy_tokens_are_the_samplers_greedy_draws():
    logits = torch.tensor([[0.1, 2.0, 2.0], [float("nan"), 1.0, 0.0], [-1.0, -3.0, 5.0],
                           [float("-inf")] * 3], dtype=torch.float32)
    pending = Sampler.greedy_later(logits)
    assert pending.tokens.tolist() == [1, 0, 2, 0]   # failed rows fill the next input with 0
    got, want = pending.batch(), Sampler()._greedy_batch(logits)
    assert (got.tokens, got.offsets, got.failures, got.first_tokens.tolist()) == \
        (want.tokens, want.offsets, want.failures, want.first_tokens.tolist())
    assert set(got.failures) == {1, 3} and got.logprobs is None


def test_best_of_samples_are_still_ranked_by_their_log_probabilities(monkeypatch, counted):
    # best_of > n ranks its samples by cumulative log-probability: their rows must keep computing it (a found
    # bug: after the first step forked them, each drew one token as a plain row and their sums stopped)
    work = [(str(i), [5 + i, 9, 14, 3 + i], SamplingParams(n=1, best_of=3, temperature=0.9, seed=7 + i,
                                                          max_tokens=10, ignore_eos=True)) for i in range(3)]
    options = dict(num_blocks=64, block_size=4, max_num_seqs=12)

    def outputs(engine):
        finals = run_requests(engine, work, max_steps=500)
        return {rid: [(list(c.token_ids), c.cumulative_logprob) for c in out.outputs] for rid, out in finals.items()}
    want = outputs(_engine(monkeypatch, False, False, async_scheduling=False, **options))
    assert outputs(_engine(monkeypatch, False, True, **options)) == want
    assert all(c[1] is not None and c[1] < 0 for out in want.values() for c in out)
