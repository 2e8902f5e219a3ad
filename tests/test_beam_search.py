"""Beam search equals transformers' `generate(num_beams=...)` exactly, and beams share KV blocks."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import TINY_MODELS, assert_no_leaks, get_model
from paged_backend import LLM, LLMEngine, SamplingParams

PROMPTS = ["The capital of France is", "Hello world, this is a test of", "Q"]
EOS = 2

# Every value of each dimension appears for every model: (beam_width, early_stopping) pairs are all
# covered, n and length_penalty cycle through their values, max_tokens spans 8..24.
CASES = [(k, es, n_is_k, lp, mt) for (k, es), n_is_k, lp, mt in zip(
    itertools.product([2, 4, 6], [False, True, "never"]),
    itertools.cycle([False, True]), itertools.cycle([0.0, 1.0, 2.0]), itertools.cycle([8, 16, 24, 12]))]


def hf_beams(model, tok, prompt, k, n, lp, es, max_tokens):
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, num_beams=k, num_return_sequences=n, do_sample=False, length_penalty=lp,
                         early_stopping=es, max_new_tokens=max_tokens, output_scores=True,
                         return_dict_in_generate=True)
    seqs = []
    for row in out.sequences[:, ids.input_ids.shape[1]:].tolist():
        seqs.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_beam_search_matches_hf(name, dtype):
    model, tok = get_model(name, dtype)
    score_tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    llm = LLM(model, tokenizer=tok, num_blocks=256, block_size=8)
    for k, es, n_is_k, lp, mt in CASES:
        n = k if n_is_k else 1
        params = SamplingParams(beam_width=k, n=n, temperature=0, length_penalty=lp, early_stopping=es,
                                max_tokens=mt)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            ref_tokens, ref_scores = hf_beams(model, tok, prompt, k, n, lp, es, mt)
            assert [c.token_ids for c in out.outputs] == ref_tokens, (k, n, lp, es, mt, prompt)
            for c, score in zip(out.outputs, ref_scores):
                assert abs(c.beam_score - score) < score_tolerance
                expected_sum = score * len(c.token_ids) ** lp
                assert abs(c.cumulative_logprob - expected_sum) < 1e-4 * max(1.0, abs(expected_sum))
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("mode", [None, "recompute"])
def test_beam_search_under_preemption_matches_hf(mode, dtype):
    model, tok = get_model("tiny-llama", dtype)
    llm = LLM(model, tokenizer=tok, num_blocks=14, block_size=4, preemption_mode=mode)
    params = SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=16, length_penalty=1.0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions if mode is None else stats.num_recompute_preemptions) > 0
    for prompt, out in zip(PROMPTS, outs):
        ref_tokens, _ = hf_beams(model, tok, prompt, 3, 3, 1.0, False, 16)
        assert [c.token_ids for c in out.outputs] == ref_tokens
    assert_no_leaks(llm.engine)


def peak_blocks(params, copies=1, prompt="Paged memory lets beams share the blocks of their common prefix"):
    model, tok = get_model("tiny-llama")
    llm = LLM(model, tokenizer=tok, num_blocks=512, block_size=8)
    llm.generate([prompt] * copies, params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return llm.get_stats().peak_used_blocks


@pytest.mark.parametrize("width", [4, 6])
def test_beams_use_fewer_blocks_than_independent_sequences(width):
    beams = peak_blocks(SamplingParams(beam_width=width, temperature=0, max_tokens=24, early_stopping="never"))
    independent = peak_blocks(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), copies=width)
    saving = 1 - beams / independent
    print(f"beam width {width}: {beams} vs {independent} blocks, saving {saving:.1%}")
    assert beams < independent


@pytest.mark.parametrize("n", [2, 4, 6])
def test_parallel_samples_use_fewer_blocks_than_independent_sequences(n):
    shared = peak_blocks(SamplingParams(n=n, temperature=1.0, max_tokens=24, ignore_eos=True, seed=0))
    independent = peak_blocks(SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=0), copies=n)
    print(f"n={n}: {shared} vs {independent} blocks, saving {1 - shared / independent:.1%}")
    assert shared < independent


def test_aborting_a_beam_search_midway_frees_every_block():
    model, tok = get_model("tiny-gpt2")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=4)
    engine.add_request("beam", PROMPTS[0], SamplingParams(beam_width=4, n=2, temperature=0, max_tokens=30,
                                                          early_stopping="never"))
    engine.add_request("other", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5))
    for _ in range(6):
        engine.step()
    assert len(engine.groups["beam"].seqs) == 4
    [out] = engine.abort_request("beam")
    assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_beam_forks_copy_only_the_partly_filled_block():
    model, tok = get_model("tiny-llama")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=128, block_size=8)
    prompt = tok("one two three four five six seven eight nine ten eleven").input_ids
    engine.add_request("b", prompt, SamplingParams(beam_width=4, temperature=0, max_tokens=12, early_stopping="never"))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    # at most one copy per new beam per step (a fork that then writes into a shared partial block)
    assert 0 < engine.get_stats().num_copy_on_write <= 4 * steps


@pytest.mark.parametrize("stops", [["kef", "Structures"], [" Here"], ["ymbol"]])
@pytest.mark.parametrize("n", [1, 3])
def test_beam_search_with_stop_strings_matches_hf(stops, n):
    """A candidate whose text completes a stop string ends like EOS does (transformers' `stop_strings`)."""
    model, tok = get_model("tiny-llama")
    llm = LLM(model, tokenizer=tok, num_blocks=256, block_size=8)
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(beam_width=3, n=n, temperature=0, max_tokens=12, stop=stops),
                       use_tqdm=False)[0]
    ids = tok(prompt, return_tensors="pt")
    ref = model.generate(**ids, num_beams=3, num_return_sequences=n, do_sample=False, max_new_tokens=12,
                         stop_strings=stops, tokenizer=tok, pad_token_id=0, eos_token_id=EOS)
    for c, row in zip(out.outputs, ref[:, ids.input_ids.shape[1]:].tolist()):
        assert row[:len(c.token_ids)] == c.token_ids and set(row[len(c.token_ids):]) <= {0, EOS}, (row, c.token_ids)
        if c.finish_reason == "stop" and c.stop_reason in stops:
            full = tok.decode(c.token_ids)
            assert c.stop_reason in full and c.stop_reason not in c.text and full.startswith(c.text)
    assert len(out.outputs) == n
    assert_no_leaks(llm.engine)
