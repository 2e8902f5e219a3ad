"""AsyncLLMEngine: per-request streams, cancellation frees blocks, one bad request fails alone."""

from __future__ import annotations

import asyncio

import pytest

from conftest import get_model
from paged_backend import AsyncLLMEngine, LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_engine(**options):
    model, tok = get_model("tiny-llama")
    options.setdefault("num_blocks", 64)
    return AsyncLLMEngine(model, tokenizer=tok, block_size=8, **options)


async def collect(engine, prompt, params, request_id=None):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs


def test_streams_are_cumulative_and_match_offline_generation():
    async def main():
        engine = make_engine()
        prompts = [f"Stream number {i} says" for i in range(6)]
        results = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        await engine.shutdown()
        return prompts, results
    prompts, results = asyncio.run(main())
    model, tok = get_model("tiny-llama")
    expected = LLM(model, tokenizer=tok, num_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    for outs, ref in zip(results, expected):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 8
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text


def test_cancelling_a_stream_aborts_the_request_and_frees_blocks():
    async def main():
        engine = make_engine()
        seen = []
        async for out in engine.generate("Cancel me after a few tokens", SamplingParams(max_tokens=200,
                                                                                      ignore_eos=True)):
            seen.append(out)
            if len(out.outputs[0].token_ids) >= 3:
                break
        task = asyncio.ensure_future(collect(engine, "Cancelled as a task", SamplingParams(max_tokens=500,
                                                                                          ignore_eos=True),
                                             "cancel-me"))
        while "cancel-me" not in engine.engine.groups:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_idle()
        stats = engine.get_stats()
        await engine.shutdown()
        return seen, stats
    seen, stats = asyncio.run(main())
    assert len(seen[-1].outputs[0].token_ids) == 3
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0
    # both ended as aborted, long before the 200 and 500 tokens they asked for
    assert stats.num_requests_aborted == 2 and stats.num_requests_finished == 2
    assert stats.num_generated_tokens < 100


def test_a_bad_request_fails_alone():
    async def main():
        engine = make_engine()
        good = asyncio.ensure_future(collect(engine, "Keep going", GREEDY))
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(engine, "", GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, [10**7], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(engine, "a", GREEDY, "same"), collect(engine, "b", GREEDY, "same"))
        outs = await good
        await engine.wait_idle()
        stats = engine.get_stats()
        await engine.shutdown()
        return outs, stats
    outs, stats = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert stats.num_free_blocks == stats.num_blocks


def test_explicit_abort_and_shutdown_free_everything():
    async def main():
        engine = make_engine()
        streams = [engine.generate(f"Long {i}", SamplingParams(max_tokens=300, ignore_eos=True), f"r{i}")
                   for i in range(4)]
        firsts = [await s.__anext__() for s in streams]
        await engine.abort("r0")
        rest = [o async for o in streams[0]]
        await engine.shutdown()
        return firsts, rest, engine.engine.get_stats()
    firsts, rest, stats = asyncio.run(main())
    assert all(not f.finished for f in firsts)
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
