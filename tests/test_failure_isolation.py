"""A failure belongs to the request that caused it: faults injected into one request's sampling or into one
step's forward fail those requests only, the others finish with the tokens they get alone; a runner that
cannot continue marks the engine failed (and the HTTP server unhealthy) instead of aborting forever."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import AsyncLLMEngine, LLMEngine, SamplingParams
from paged_backend.errors import EngineDeadError

MAX_STEPS = 500


def fail_at(num_tokens: int, message: str = "injected fault"):
    """A logits processor that raises once the request has generated `num_tokens` tokens."""
    def processor(output_ids, logits):
        if len(output_ids) >= num_tokens:
            raise RuntimeError(message)
        return logits
    return processor



def tokens_alone(model, tok, prompt, params):
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8)
    engine.add_request("alone", prompt, params)
    return [c.token_ids for c in run_to_completion(engine, MAX_STEPS)["alone"].outputs]


HEALTHY = {
    "greedy": ("The capital of France is", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
    "seeded": ("Once upon a time", SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=5, max_tokens=10,
                                                  ignore_eos=True)),
    "beams": ("Hello world, this is", SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=8)),
}


def test_a_fault_in_one_requests_sampling_fails_that_request_only(dtype, caplog):
    model, tok = get_model("tiny-llama", dtype)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8)
    for rid, (prompt, params) in HEALTHY.items():
        engine.add_request(rid, prompt, params)
    engine.add_request("faulty", "A request whose processor breaks",
                       SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, logits_processors=[fail_at(3)]))
    engine.add_request("faulty-beams", "Beams whose processor breaks",
                       SamplingParams(beam_width=2, temperature=0, max_tokens=10, logits_processors=[fail_at(2)]))
    with caplog.at_level(logging.ERROR, logger="paged_backend"):
        outs = run_to_completion(engine, MAX_STEPS)
    for rid in ("faulty", "faulty-beams"):
        assert "injected fault" in outs[rid].error and all(c.finish_reason == "abort" for c in outs[rid].outputs)
        assert sum("failed" in r.getMessage() and repr(rid) in r.getMessage() for r in caplog.records) == 1
    assert len(outs["faulty"].outputs[0].token_ids) == 3
    for rid, (prompt, params) in HEALTHY.items():
        assert outs[rid].error is None
        assert [c.token_ids for c in outs[rid].outputs] == tokens_alone(model, tok, prompt, params), rid
    stats = engine.get_stats()
    assert stats.num_requests_failed == 2 and stats.num_requests_finished == len(HEALTHY)
    assert engine.errored is None
    assert_no_leaks(engine)


@pytest.mark.timeout(120)   # results never released would leave the engine waiting
@pytest.mark.parametrize("reports_launch", [False, True], ids=["plain-runner", "runner-reports-launch"])
def test_a_failed_forward_fails_the_steps_requests_and_the_engine_goes_on(reports_launch):
    """Also with a runner that says when its forward is on its way and fails before: the step before it, whose
    results wait for that moment (overlapped scheduling), is still delivered."""
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for rid in ("first", "second", "third"):  # two run, the third waits for a sequence slot
        engine.add_request(rid, f"The {rid} request says", params)
    execute, calls = engine.runner.execute, []

    def flaky(inputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device hiccup")
        return execute(inputs)

    def flaky_reporting(inputs, on_launched=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device hiccup")
        return execute(inputs, on_launched=on_launched)

    engine.runner.execute = flaky_reporting if reports_launch else flaky
    outs = run_to_completion(engine, MAX_STEPS)
    for rid in ("first", "second"):
        assert "device hiccup" in outs[rid].error
    assert outs["third"].error is None
    assert [c.token_ids for c in outs["third"].outputs] == tokens_alone(model, tok, "The third request says", params)
    assert engine.errored is None and engine.get_stats().num_requests_failed == 2
    assert_no_leaks(engine)


def test_a_runner_that_cannot_continue_fails_everything_and_refuses_more():
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, max_num_seqs=1)
    for rid in ("running", "waiting"):
        engine.add_request(rid, "Some prompt", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()

    def dead(inputs):
        raise EngineDeadError("rank 1 died")

    engine.runner.execute = dead
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        for _ in range(2):  # with overlapped scheduling the step launched ahead may still have run on the old runner
            engine.step()
    assert isinstance(engine.errored, EngineDeadError)
    assert not engine.has_unfinished_requests() and engine.get_stats().num_requests_failed == 2
    with pytest.raises(EngineDeadError):
        engine.add_request("later", "Another prompt", SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError):
        engine.step()
    assert_no_leaks(engine)


def make_async(**options):
    model, tok = get_model("tiny-llama", torch.float32)
    return AsyncLLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, **options)


async def last_output(engine, prompt, params, request_id=None):
    out = None
    async for out in engine.generate(prompt, params, request_id):
        pass
    return out


def test_async_engine_keeps_serving_after_one_request_fails():
    async def main():
        engine = make_async()
        good = [asyncio.ensure_future(last_output(engine, prompt, params)) for prompt, params in HEALTHY.values()]
        bad = await last_output(engine, "Broken", SamplingParams(max_tokens=9, ignore_eos=True,
                                                                 logits_processors=[fail_at(2)]))
        results = await asyncio.gather(*good)
        after = await last_output(engine, "Still serving", SamplingParams(temperature=0, max_tokens=4))
        await engine.shutdown()
        return engine, bad, results, after
    engine, bad, results, after = asyncio.run(main())
    assert bad.finished and "injected fault" in bad.error
    model, tok = get_model("tiny-llama", torch.float32)
    for out, (prompt, params) in zip(results, HEALTHY.values()):
        assert out.error is None and [c.token_ids for c in out.outputs] == tokens_alone(model, tok, prompt, params)
    assert after.error is None and len(after.outputs[0].token_ids) == 4
    assert engine.errored is None and engine.get_stats().num_requests_failed == 1


def test_async_engine_that_cannot_continue_ends_every_stream_and_reports_itself():
    async def main():
        engine = make_async(max_num_seqs=1)
        streams = [asyncio.ensure_future(last_output(engine, f"Prompt {i}", SamplingParams(max_tokens=50,
                                                                                            ignore_eos=True)))
                   for i in range(3)]
        await asyncio.sleep(0)
        while engine.engine.counters.num_steps < 2:
            await asyncio.sleep(0.01)

        def dead(inputs):
            raise EngineDeadError("the accelerator is gone")

        engine.engine.runner.execute = dead
        results = await asyncio.gather(*streams, return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await last_output(engine, "After", SamplingParams(max_tokens=2))
        stats = engine.engine.get_stats()
        await engine.shutdown()
        return engine, results, stats
    engine, results, stats = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert isinstance(engine.errored, EngineDeadError)
    assert stats.num_free_blocks == stats.num_blocks


def test_http_health_turns_503_when_the_engine_cannot_continue():
    from fastapi.testclient import TestClient

    from paged_backend.adapters.http.app import create_app

    engine = make_async()
    with TestClient(create_app(engine, model_name="tiny")) as http:
        assert http.get("/health").status_code == 200
        ok = http.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert ok.status_code == 200

        def dead(inputs):
            raise EngineDeadError("the accelerator is gone")

        engine.engine.runner.execute = dead
        failed = http.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert failed.status_code in (424, 500, 503) and "error" in failed.json()  # TGI: 424 generation error
        health = http.get("/health")
        assert health.status_code == 503 and "accelerator" in health.json()["error"]
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code in (500, 503) and "error" in refused.json()


# ---- issue 20, case 4: a failed row leaves its neighbours' tokens, logprobs and draws exactly as they were --------
def force_eos_at(num_tokens: int, eos: int):
    """The healthy twin of a fault at `num_tokens`: the request ends there (EOS), so the batch changes as it would."""
    def processor(output_ids, logits):
        if len(output_ids) >= num_tokens:
            keep = logits[eos].clone()
            logits.fill_(float("-inf"))
            logits[eos] = keep
        return logits
    return processor


def nan_at(num_tokens: int):
    def processor(output_ids, logits):
        return logits.fill_(float("nan")) if len(output_ids) >= num_tokens else logits
    return processor


NEIGHBOURS = {
    "seeded-penalties": ("Once upon a time", SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=50, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, logit_bias={5: 2.0, 17: -1.5}, max_tokens=8, ignore_eos=True, logprobs=3)),
    "seeded-min-p": ("Far away", SamplingParams(temperature=1.3, min_p=0.02, seed=3, max_tokens=8, ignore_eos=True,
                                                logprobs=2)),
    "unseeded": ("A story", SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, logprobs=1)),
    "greedy": ("The capital of France is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)),
    "greedy-penalised": ("Hello world", SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={9: 1.0},
                                                       max_tokens=8, ignore_eos=True)),
}


def faulty_requests(eos: int, healthy: bool):
    """Requests that fail (or, `healthy`, end by EOS at the same step instead): nothing left after min_tokens
    masks EOS, a processor that raises, a processor that returns NaN."""
    return {
        "min-tokens": ("Only EOS", SamplingParams(temperature=1.0, allowed_token_ids=[eos], max_tokens=5,
                                                  min_tokens=0 if healthy else 3)),
        "raises": ("Raises later", SamplingParams(temperature=1.0, max_tokens=8, logits_processors=[
            force_eos_at(2, eos) if healthy else fail_at(2)])),
        "nan": ("NaN later", SamplingParams(temperature=0.8, max_tokens=8, logits_processors=[
            force_eos_at(2, eos) if healthy else nan_at(2)])),
    }


def run_beside(model, tok, healthy: bool):
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, seed=7)
    eos = engine.eos_token_ids[0]
    for rid, (prompt, params) in {**NEIGHBOURS, **faulty_requests(eos, healthy)}.items():
        engine.add_request(rid, prompt, params)
    outs = run_to_completion(engine, MAX_STEPS)
    assert_no_leaks(engine)
    return outs


def test_a_failed_row_leaves_its_neighbours_bit_identical(dtype):
    model, tok = get_model("tiny-llama", dtype)
    failed, healthy = run_beside(model, tok, healthy=False), run_beside(model, tok, healthy=True)
    for rid in ("min-tokens", "raises", "nan"):
        assert failed[rid].error is not None and healthy[rid].error is None, rid
        # none of the failing step's effects: the output stops before the step that failed
        assert failed[rid].outputs[0].token_ids == healthy[rid].outputs[0].token_ids[:-1], rid
    assert "nothing to sample" in failed["min-tokens"].error and "nothing to sample" in failed["nan"].error
    assert "injected fault" in failed["raises"].error
    for rid in NEIGHBOURS:
        assert failed[rid].error is None
        for got, want in zip(failed[rid].outputs, healthy[rid].outputs, strict=True):
            assert (got.token_ids, got.cumulative_logprob, got.logprobs) == \
                (want.token_ids, want.cumulative_logprob, want.logprobs), rid


def test_the_sampler_isolates_a_failed_row_and_its_draws(dtype):
    """At the sampler: the same batch with one row failing or not gives the other rows the same tokens, logprobs
    and top logprobs, and leaves every other generator (seeded and the engine's) in the same state."""
    from paged_backend.sampling.sampler import SampleRequest, Sampler
    from paged_backend.core.sequence import Sequence

    vocab = 300
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1), dtype=dtype)
    params = [SamplingParams(temperature=0.7, seed=1, presence_penalty=0.4, repetition_penalty=1.3,
                             logprobs=2, n=2),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=20, seed=2, logprobs=1),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_p=0.8)]

    def run(fault):
        seqs = [Sequence([3, 4, 5, 9]) for _ in params]
        for seq in seqs:
            seq.token_ids.append(6)
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        processors = [fail_at(0)] if fault else []
        row_params = list(params)
        row_params[1] = row_params[1].replace(logits_processors=processors)
        requests = [SampleRequest(p, s, p.n, g) for p, s, g in zip(row_params, seqs, gens)]
        sampler = Sampler(seed=3)
        results = sampler.sample(logits.clone(), requests)
        states = [g.get_state() for g in gens if g is not None] + [sampler.generator.get_state()]
        return results, states

    failed, failed_states = run(fault=True)
    healthy, healthy_states = run(fault=False)
    assert failed[1].error is not None and "injected fault" in failed[1].error and not failed[1].token_ids
    for i in (0, 2, 3, 4):
        assert failed[i].error is None
        assert (failed[i].token_ids, failed[i].logprobs, failed[i].top_logprobs) == \
            (healthy[i].token_ids, healthy[i].logprobs, healthy[i].top_logprobs), i
    assert all(torch.equal(a, b) for a, b in zip(failed_states, healthy_states))


# ---- issue 20, cases 3 and 5: a failed beam step frees what it forked; one request fails once ----------------------
def test_failed_beam_steps_free_every_block_they_forked(monkeypatch):
    """The matcher fails on a beam's third continuation, after two children were forked: the children's blocks
    come back, so after many such failures a request that needs the whole cache still runs."""
    from paged_backend.structured.matcher import GrammarState

    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=8, block_size=8)
    accept, calls = GrammarState.accept, []

    def failing_third_accept(self, token_id):
        calls.append(token_id)
        if len(calls) % 3 == 0:
            raise RuntimeError("injected matcher fault")
        return accept(self, token_id)

    monkeypatch.setattr(GrammarState, "accept", failing_third_accept)
    for i in range(10):
        calls.clear()
        engine.add_request(f"beams-{i}", "Pick a number:", SamplingParams(
            beam_width=4, temperature=0, max_tokens=6, structured_outputs={"regex": "[0-9]{3}"}))
        out = run_to_completion(engine, MAX_STEPS)[f"beams-{i}"]
        assert "injected matcher fault" in out.error
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_blocks, (i, stats)
    monkeypatch.undo()
    prompt = tok("Tell me", add_special_tokens=False)["input_ids"]
    engine.add_request("whole-cache", prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                             max_tokens=8 * 8 - len(prompt)))
    out = run_to_completion(engine, MAX_STEPS)["whole-cache"]
    assert out.error is None and len(out.outputs[0].token_ids) == 8 * 8 - len(prompt)
    assert_no_leaks(engine)


def test_a_beam_request_whose_rows_fail_one_after_another_keeps_its_first_error(caplog):
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8)
    first_beam = {}

    def second_row_fails(output_ids, logits):   # from the second step on, only the first beam's row passes
        if output_ids and first_beam.setdefault(len(output_ids), tuple(output_ids)) != tuple(output_ids):
            raise RuntimeError("the second beam's row broke")
        return logits

    engine.add_request("beams", "Hello world", SamplingParams(beam_width=2, temperature=0, max_tokens=6,
                                                               logits_processors=[second_row_fails]))
    with caplog.at_level(logging.ERROR, logger="paged_backend"):
        out = run_to_completion(engine, MAX_STEPS)["beams"]
    assert "the second beam's row broke" in out.error, out.error
    assert sum("'beams' failed" in r.getMessage() for r in caplog.records) == 1
    assert engine.get_stats().num_requests_failed == 1
    assert_no_leaks(engine)
