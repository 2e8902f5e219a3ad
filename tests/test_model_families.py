"""Modern attention families through the paged engine equal transformers' own `generate`, token for token.

Tiny random models (loader presets, windows of 8 tokens, blocks of 4, 8 and 16 tokens): Mistral, Phi-3, Starcoder2
(window on every layer), Qwen2 (`use_sliding_window`, one full and one windowed layer), Gemma 2
(logit soft-cap on every layer, alternating window / full), Gemma 3 (local / global), Cohere2
(window / full), gpt-oss (sinks, window / full). Prompts are longer than the window and generations
cross it many times; runs use chunked prefill, prefix caching and preemption in both modes.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLM, SamplingParams
from paged_backend.worker.loader import FAMILY_PRESETS
from paged_backend.worker.model_support import probe_attention

WINDOW = 8
SHARED = "Paged attention splits the key value cache into blocks of a fixed size, and "
PROMPTS = [
    SHARED + "the first question is",
    SHARED + "a second request asks what",
    "Hi",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
]
MAX_TOKENS = 24
DTYPES = [torch.float64, torch.float32]


@lru_cache(maxsize=None)
def hf_greedy(name: str, dtype: torch.dtype):
    """transformers' generate, one prompt at a time (no padding)."""
    model, tok = get_model(name, dtype)
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        seq = model.generate(**ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        outs.append(seq[0, ids.input_ids.shape[1]:].tolist())
    return outs


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_greedy_matches_hf_with_chunked_prefill_and_prefix_caching(name, dtype):
    """Chunks of at most 6 tokens (prompts are 18-21 tokens: three or four chunks, and a chunk's window
    reaches into the previous chunks), then the second request reuses the first one's cached blocks."""
    model, tok = get_model(name, dtype)
    assert max(len(tok(p).input_ids) for p in PROMPTS) > 2 * WINDOW
    assert any(kind.sliding_window == WINDOW for kind in probe_attention(model))
    llm = LLM(model, tokenizer=tok, num_blocks=64, block_size=8, max_num_batched_tokens=6,
              enable_prefix_caching=True)
    tokens = _greedy(llm, PROMPTS[:1]) + _greedy(llm, PROMPTS[1:])
    assert tokens == hf_greedy(name, dtype)
    assert llm.get_stats().num_cached_prefill_tokens >= 8
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode, block_size, num_blocks", [("recompute", 4, 20), ("swap", 16, 5)])
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_greedy_matches_hf_under_preemption(name, mode, block_size, num_blocks, dtype):
    """80 cache slots for four sequences of up to 45 tokens; blocks of 4 (a window spans three blocks) and
    of 16 (a window lies within one or two). A model windowed on every layer releases the blocks behind
    its window and needs only a few blocks per sequence: 32 slots are small enough to preempt it."""
    model, tok = get_model(name, dtype)
    if all(kind.sliding_window is not None for kind in probe_attention(model)) and block_size == 4:
        num_blocks = 8
    llm = LLM(model, tokenizer=tok, num_blocks=num_blocks, block_size=block_size, preemption_mode=mode)
    assert _greedy(llm, PROMPTS) == hf_greedy(name, dtype)
    stats = llm.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert_no_leaks(llm.engine)


def hf_beams(model, tok, prompt, width, n, max_tokens):
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, num_beams=width, num_return_sequences=n, do_sample=False, length_penalty=1.0,
                         early_stopping=False, max_new_tokens=max_tokens, output_scores=True,
                         return_dict_in_generate=True)
    eos = model.generation_config.eos_token_id
    seqs = []
    for row in out.sequences[:, ids.input_ids.shape[1]:].tolist():
        seqs.append(row[: row.index(eos) + 1] if eos in row else row)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_beam_search_matches_hf(name, dtype):
    """Beams fork inside a window and share (copy-on-write) the blocks of their common prefix."""
    model, tok = get_model(name, dtype)
    llm = LLM(model, tokenizer=tok, num_blocks=96, block_size=8)
    params = SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=14, length_penalty=1.0)
    prompts = [PROMPTS[3], PROMPTS[2]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # Gemma 2's own attention rounds its probabilities to float32 even in a float64 model.
    tolerance = 1e-4 if dtype == torch.float32 else 1e-5 if name == "tiny-gemma2" else 1e-9
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_scores = hf_beams(model, tok, prompt, 3, 2, 14)
        assert [c.token_ids for c in out.outputs] == ref_tokens, prompt
        for completion, score in zip(out.outputs, ref_scores):
            assert abs(completion.beam_score - score) < tolerance
    assert llm.get_stats().num_copy_on_write > 0
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_beam_search_matches_hf_under_preemption_and_chunking(name, mode, dtype):
    """Beams recomputed (leader first, then forks) or swapped while prompts are prefilled in chunks of 6,
    with prefix caching on and windowed blocks released: still transformers' hypotheses."""
    model, tok = get_model(name, dtype)
    windowed = all(kind.sliding_window is not None for kind in probe_attention(model))
    llm = LLM(model, tokenizer=tok, num_blocks=8 if windowed else 12, block_size=4, max_num_batched_tokens=6,
              preemption_mode=mode, num_swap_blocks=64)
    params = SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=12, length_penalty=1.0)
    prompts = [PROMPTS[3], PROMPTS[0]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert [c.token_ids for c in out.outputs] == hf_beams(model, tok, prompt, 2, 2, 12)[0], prompt
    assert_no_leaks(llm.engine)
