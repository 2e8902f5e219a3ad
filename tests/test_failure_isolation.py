"""A failure belongs to the request that caused it: faults injected into one request's sampling or into one
step's forward fail those requests only, the others finish with the tokens they get alone; a runner that
cannot continue marks the engine failed (and the HTTP server unhealthy) instead of aborting forever."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from conftest import assert_no_leaks, get_model
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


def run_bounded(engine: LLMEngine) -> dict:
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        assert steps <= MAX_STEPS
    return finals


def tokens_alone(model, tok, prompt, params):
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8)
    engine.add_request("alone", prompt, params)
    return [c.token_ids for c in run_bounded(engine)["alone"].outputs]


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
        outs = run_bounded(engine)
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


def test_a_failed_forward_fails_the_steps_requests_and_the_engine_goes_on():
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

    engine.runner.execute = flaky
    outs = run_bounded(engine)
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
