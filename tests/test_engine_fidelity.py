"""Greedy generation through the paged engine equals Hugging Face `generate`, token for token."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from conftest import TINY_MODELS, assert_no_leaks, get_model
from paged_backend import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Hi",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms",
    "1, 2, 3, 4,",
    "Paged attention splits the key-value cache into blocks so that",
    "A",
]
MAX_TOKENS = 20


@lru_cache(maxsize=None)
def hf_greedy(name: str, dtype: torch.dtype, max_tokens: int = MAX_TOKENS):
    """HF generate, one prompt at a time (no padding involved)."""
    model, tok = get_model(name, dtype)
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        seq = model.generate(**ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        outs.append(seq[0, ids.input_ids.shape[1]:].tolist())
    return outs


def run_engine(name: str, dtype: torch.dtype, **options):
    model, tok = get_model(name, dtype)
    llm = LLM(model, tokenizer=tok, **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outs], llm.get_stats()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_matches_hf(name, dtype):
    tokens, stats = run_engine(name, dtype, num_blocks=128, block_size=16)
    assert tokens == hf_greedy(name, dtype)
    assert stats.num_preemptions == 0


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_hf_under_preemption(name, mode, dtype):
    tokens, stats = run_engine(name, dtype, num_blocks=9, block_size=8, preemption_mode=mode)
    assert tokens == hf_greedy(name, dtype)
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_preemptions > 0
    else:
        assert stats.num_recompute_preemptions > 0


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 256])
def test_block_sizes_and_sequence_budgets(block_size, max_num_seqs, dtype):
    tokens, _ = run_engine("tiny-llama", dtype, num_blocks=64, block_size=block_size, max_num_seqs=max_num_seqs)
    assert tokens == hf_greedy("tiny-llama", dtype)


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_matches_hf(budget, dtype):
    """Prompts longer than the per-step token budget are prefilled in chunks."""
    tokens, _ = run_engine("tiny-gpt-neox", dtype, num_blocks=64, block_size=8, max_num_batched_tokens=budget)
    assert tokens == hf_greedy("tiny-gpt-neox", dtype)


SMOL_PROMPTS = ["The capital of France is", "Water boils at a temperature of",
                "def fibonacci(n):", "The three primary colors are"]


def test_smollm2_real_prompts_match_hf(smollm2):
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, kv_cache_memory="64MiB")
    outs = llm.generate(SMOL_PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert outs[0].outputs[0].text.startswith(" Paris")
    for prompt, out in zip(SMOL_PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        ref = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids.input_ids.shape[1]:].tolist()
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        assert out.outputs[0].token_ids == ref, prompt
    assert_no_leaks(llm.engine)
