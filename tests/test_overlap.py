"""Overlapped scheduling (issue 22): the next step is scheduled and launched while the current one's forward runs
(`async_scheduling`, on by default). The option turns it off; a request that stops at step N gets no token from
step N+1 (computed in vain) and holds no block once its final output is returned; a failing row's neighbours are
bit-identical with overlap on and off; the engine leaves nothing running once it is idle."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams

MAX_STEPS = 500
PROMPT = "The quick brown fox jumps over"


class RecordingRunner:
    """Wraps an engine's runner: which thread ran each forward, and the sequences each one computed."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.threads = []
        self.rows = []

    def execute(self, inputs):
        self.threads.append(threading.get_ident())
        self.rows.append(len(inputs.context_lens))
        return self.runner.execute(inputs)

    def shutdown(self) -> None:
        self.runner.shutdown()


def engine_with(overlap: bool, **options) -> LLMEngine:
    model, tok = get_model("tiny-llama", torch.float64)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, async_scheduling=overlap, **options)
    engine.runner = RecordingRunner(engine.runner)
    return engine


@pytest.mark.parametrize("overlap", [False, True], ids=["off", "on"])
def test_the_option_turns_overlap_on_and_off(overlap):
    """Off: every forward runs in the caller's thread, once per step() call, and nothing is left running between
    calls. On: forwards run in the engine's worker thread and the next step is already launched when a call
    returns."""
    engine = engine_with(overlap)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    calls = 0
    while engine.has_unfinished_requests():
        engine.step()
        calls += 1
        if engine.has_unfinished_requests() and calls < 5:  # the 6th token's step launches nothing after it
            assert (engine._inflight is not None) == overlap, calls
    assert calls == 6 and len(engine.runner.rows) == 6
    me = threading.get_ident()
    assert all((t != me) == overlap for t in engine.runner.threads)
    assert_no_leaks(engine)


@pytest.mark.parametrize("stop", ["stop_token", "stop_string"])
def test_a_request_stopping_at_step_n_gets_no_token_of_step_n_plus_1_and_holds_no_block(stop):
    """The step after the stopping one was launched before the stop was known, so it computed one more token for
    the request (in vain): that token is never returned, and the request's blocks are free as soon as its final
    output is; its neighbour goes on."""
    expected, params = stopping_request(stop)
    engine = engine_with(True)
    engine.add_request("r", PROMPT, params)
    engine.add_request("neighbour", "Another prompt", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == "r" and out.finished:
                final = out
    # the step launched ahead, still running, has a row of the stopped request: computed before the stop was known
    vain = [item.seq for item in engine._inflight.sched.scheduled if item.group.request_id == "r"]
    assert vain, "the scenario must compute a token in vain"
    assert final.outputs[0].token_ids == expected.token_ids[:STOP_AT + 1]
    assert final.outputs[0].finish_reason == "stop"
    assert not any(s.seq_id in engine.block_manager.block_tables for s in vain)
    outs = run_to_completion(engine, MAX_STEPS)
    assert len(outs["neighbour"].outputs[0].token_ids) == 12
    assert engine.get_stats().num_generated_tokens == STOP_AT + 1 + 12
    assert_no_leaks(engine)


STOP_AT = 4


def stopping_request(stop: str):
    """transformers-free reference: the request's tokens without a stop, and params that stop at token STOP_AT
    (by its id, or by its text as a stop string)."""
    model, tok = get_model("tiny-llama", torch.float64)
    free = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, async_scheduling=False)
    free.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    expected = run_to_completion(free, MAX_STEPS)["r"].outputs[0]
    token = expected.token_ids[STOP_AT]
    if stop == "stop_token":
        return expected, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[token])
    piece = tok.decode([token])
    assert piece.strip() and piece not in tok.decode(expected.token_ids[:STOP_AT])
    return expected, SamplingParams(temperature=0, max_tokens=8, stop=[piece], include_stop_str_in_output=True)


def test_nothing_runs_once_the_engine_is_idle():
    """The step computed in vain after a request's stop is waited for before the engine reports itself idle, so
    no forward runs on the model while nobody steps the engine (another engine may use the same model)."""
    expected, params = stopping_request("stop_token")
    engine = engine_with(True)
    engine.add_request("r", PROMPT, params)
    outs = run_to_completion(engine, MAX_STEPS)
    assert outs["r"].outputs[0].token_ids == expected.token_ids[:STOP_AT + 1]
    assert engine._inflight is None and len(engine.runner.rows) == STOP_AT + 2  # the last one in vain
    assert_no_leaks(engine)


def run_failing_workload(overlap: bool, dtype: torch.dtype):
    from test_failure_isolation import NEIGHBOURS, faulty_requests

    model, tok = get_model("tiny-llama", dtype)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, seed=7, async_scheduling=overlap)
    for rid, (prompt, params) in {**NEIGHBOURS, **faulty_requests(engine.eos_token_ids[0], False)}.items():
        engine.add_request(rid, prompt, params)
    outs = run_to_completion(engine, MAX_STEPS)
    assert_no_leaks(engine)
    return outs


def test_a_failing_row_fails_alike_and_its_neighbours_are_identical_with_overlap_on_and_off(dtype):
    on, off = run_failing_workload(True, dtype), run_failing_workload(False, dtype)
    assert on.keys() == off.keys()
    for rid in on:
        assert on[rid].error == off[rid].error, rid
        for a, b in zip(on[rid].outputs, off[rid].outputs, strict=True):
            assert (a.token_ids, a.text, a.cumulative_logprob, a.logprobs, a.finish_reason) == \
                (b.token_ids, b.text, b.cumulative_logprob, b.logprobs, b.finish_reason), rid


def test_aborting_every_request_while_a_step_runs_leaves_nothing_running():
    """An abort frees the request's blocks at once; when it was the last request, the step launched ahead (all
    in vain now) is waited for, and the engine serves the next request normally."""
    engine = engine_with(True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("r", PROMPT, params)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    (out,) = engine.abort_request("r")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    assert engine._inflight is None
    assert_no_leaks(engine)
    engine.add_request("again", PROMPT, params)
    again = run_to_completion(engine, MAX_STEPS)["again"].outputs[0]
    model, tok = get_model("tiny-llama", torch.float64)
    alone = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, async_scheduling=False)
    alone.add_request("again", PROMPT, params)
    assert again.token_ids == run_to_completion(alone, MAX_STEPS)["again"].outputs[0].token_ids
    assert_no_leaks(engine)


def test_our_attention_stays_the_models_while_any_engine_on_it_runs_a_step():
    """Two engines on one model object: one engine's step ending (in its worker thread, with overlap) must not
    give the model its previous attention back while the other engine's step is still in its forward."""
    model, tok = get_model("tiny-llama", torch.float64)
    first = LLMEngine(model, tokenizer=tok, num_blocks=16, block_size=8)
    second = LLMEngine(model, tokenizer=tok, num_blocks=16, block_size=8)
    before = model.config._attn_implementation
    with first.runner._paged_attention():
        with second.runner._paged_attention():
            ours = model.config._attn_implementation
        assert model.config._attn_implementation == ours   # the first engine's step is still running
    assert ours != before and model.config._attn_implementation == before
    first_step, second_step = first.runner._paged_attention(), second.runner._paged_attention()
    first_step.__enter__()
    second_step.__enter__()
    first_step.__exit__(None, None, None)                   # steps of two engines end in any order
    assert model.config._attn_implementation == ours      # the second one's step is still running
    second_step.__exit__(None, None, None)
    assert model.config._attn_implementation == before


class SuccessorWaitingRunner(RecordingRunner):
    """Each forward waits (up to a bound) until the engine has launched the step after it, as a forward that
    takes longer than scheduling does."""

    def __init__(self, runner, engine) -> None:
        super().__init__(runner)
        self.engine = engine

    def execute(self, inputs):
        self.wait_for_successor(inputs)
        return super().execute(inputs)

    def wait_for_successor(self, inputs) -> None:
        import time

        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and self.engine.has_unfinished_requests():
            launched = self.engine._inflight
            if launched is not None and launched.inputs is not inputs:
                break
            time.sleep(0.001)


def assert_tokens_as_without_overlap(outputs, prompts, params) -> None:
    """Each request's tokens equal those of an engine without overlap."""
    reference = engine_with(False)
    for request_id, prompt in prompts.items():
        reference.add_request(request_id, prompt, params)
    expected = run_to_completion(reference, max_steps=MAX_STEPS)
    assert {k: o.outputs[0].token_ids for k, o in outputs.items()} == \
        {k: o.outputs[0].token_ids for k, o in expected.items()}


def test_a_steps_sampled_tokens_fill_the_launched_successor_before_its_results_are_released():
    """The worker fills the next step's pending input ids from a step's draws before it hands the step's results
    to the engine's thread: the successor's forward then starts without waiting for that thread (which, woken
    by the results, holds the interpreter while it processes them). Tokens equal the run without overlap."""
    engine = engine_with(True)
    engine.runner = SuccessorWaitingRunner(engine.runner.runner, engine)
    late_fills = []   # per step with pending inputs: were they still unfilled once its predecessor was released?
    original_execute = engine._execute

    def execute(launched, previous):
        if launched.fill is not None:
            late_fills.append(previous.future.done() and not launched.filled)
        return original_execute(launched, previous)

    engine._execute = execute
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {f"r{i}": PROMPT + " over" * i for i in range(3)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs = run_to_completion(engine, max_steps=MAX_STEPS)
    assert len(late_fills) >= 5 and not any(late_fills), late_fills
    assert_tokens_as_without_overlap(outputs, prompts, params)
    assert_no_leaks(engine)


class DeviceLikeRunner(SuccessorWaitingRunner):
    """A forward as a device runs one: it waits until the step after it is launched (a forward outlasting
    scheduling), holds the interpreter for a while (input copies, kernel launches), reports the forward handed
    over (`on_launched`), then waits for the device (asleep, the interpreter free) before computing."""

    def __init__(self, runner, engine, events) -> None:
        super().__init__(runner, engine)
        self.events = events
        self.forwards = 0

    def execute(self, inputs, on_launched=None):
        import time

        self.wait_for_successor(inputs)
        busy_until = time.perf_counter() + 0.003
        while time.perf_counter() < busy_until:
            pass
        self.events.append(("launched", self.forwards))
        self.forwards += 1
        if on_launched is not None:
            on_launched()
        time.sleep(0.01)
        return RecordingRunner.execute(self, inputs)


def test_a_steps_results_are_released_once_the_next_steps_forward_is_launched():
    """With the next step already launched, the worker hands a step's results to the engine's thread only once
    the next forward is on its way (the runner's `on_launched`): the engine's processing then runs while the
    device works, instead of holding the interpreter while the worker still prepares the next forward. Tokens
    equal the run without overlap and nothing is held at the end."""
    engine = engine_with(True)
    events = []
    engine.runner = DeviceLikeRunner(engine.runner.runner, engine, events)
    original_process = engine.tokens.process
    processed = [0]

    def process(*args, **kwargs):
        events.append(("processed", processed[0]))
        processed[0] += 1
        return original_process(*args, **kwargs)

    engine.tokens.process = process
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {f"r{i}": PROMPT + " over" * i for i in range(3)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs = run_to_completion(engine, max_steps=MAX_STEPS)
    order = {event: k for k, event in enumerate(events)}
    forwards = engine.runner.forwards
    early = [step for step in range(forwards - 1)
             if ("processed", step) in order and order[("processed", step)] < order[("launched", step + 1)]]
    assert forwards >= 8 and not early, (early, events)
    assert_tokens_as_without_overlap(outputs, prompts, params)
    assert_no_leaks(engine)
