"""Sliding-window memory: when every layer attends through a window of W tokens, blocks wholly before a
sequence's last W tokens are released as it advances, so a long generation holds ceil(W / block_size) + 1
blocks, not O(length), and its tokens still equal transformers'. Models that mix windowed and full layers
keep every block."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_no_leaks, get_model, hf_greedy_tokens
from paged_backend import LLMEngine, SamplingParams

WINDOW = 8


def run_watching_blocks(engine, until_len):
    """Step to the end; the most blocks any sequence held once it was `until_len` tokens long or longer."""
    finals, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        long = [s for g in engine.scheduler.running for s in g.unfinished_seqs() if len(s) >= until_len]
        if long:
            most = max(most, max(engine.block_manager.num_held_blocks(s) for s in long))
    return finals, most


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-phi3", "tiny-starcoder2"])
def test_a_windowed_model_holds_o_window_blocks_and_the_same_tokens(name, block_size, dtype):
    model, tok = get_model(name, dtype)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=block_size)
    assert engine.sliding_window == WINDOW
    prompts = {"short": tok("Hi there").input_ids, "long": tok("Paged attention splits memory into blocks "
                                                               "that are allocated on demand").input_ids}
    max_tokens = 4 * WINDOW
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finals, most = run_watching_blocks(engine, until_len=2 * WINDOW)
    bound = math.ceil(WINDOW / block_size) + 1
    assert most <= bound, (most, bound)
    assert engine.get_stats().max_blocks_per_seq <= bound
    for rid, ids in prompts.items():
        assert finals[rid].outputs[0].token_ids == hf_greedy_tokens(model, ids, max_tokens), rid
    assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_release_with_samples_beams_prefix_caching_and_preemption(mode):
    """Samples and beams fork sequences whose early blocks are already released; preemption moves or
    recomputes them; the prefix cache keeps released blocks for later requests. Same tokens as alone."""
    model, tok = get_model("tiny-mistral", torch.float32)
    prompt = tok("Paged attention splits the key value cache into blocks of a fixed size").input_ids
    requests = {
        "samples": SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=28, ignore_eos=True),
        "beams": SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=20),
        "greedy": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    }
    engine = LLMEngine(model, tokenizer=tok, num_blocks=10, block_size=4, enable_prefix_caching=True,
                       preemption_mode=mode, num_swap_blocks=64, max_num_batched_tokens=12)
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params)
    finals, _ = run_watching_blocks(engine, until_len=1)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for rid, params in requests.items():
        alone = LLMEngine(model, tokenizer=tok, num_blocks=256, block_size=4)
        alone.add_request(rid, prompt, params)
        expected, _ = run_watching_blocks(alone, until_len=1)
        assert [c.token_ids for c in finals[rid].outputs] == [c.token_ids for c in expected[rid].outputs], rid
    assert_no_leaks(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_model_with_full_layers_keeps_every_block(overlap):
    model, tok = get_model("tiny-gemma2", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=4, async_scheduling=overlap)
    assert engine.sliding_window is None
    ids = tok("Hi there").input_ids
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=4 * WINDOW, ignore_eos=True))
    _, most = run_watching_blocks(engine, until_len=1)
    # between steps every token but the newest has its slot (the last one ends the request): all stay; with
    # overlapped scheduling the next step is already scheduled, so the newest has its slot too (but the last)
    newest = 1 if overlap else 2
    assert most == math.ceil((len(ids) + 4 * WINDOW - newest) / 4) > math.ceil(WINDOW / 4) + 1
    assert_no_leaks(engine)
