"""LoRA adapters chosen per request equal PEFT's own models, token for token: greedy and beam search, float64
and float32, each adapter alone and three adapters with the base model in one batch (one forward per step),
under memory pressure with both preemptions; with fewer device slots than adapters (LRU swap-ins); and
KV computed under one adapter is never reused under another (the prefix cache's hashes start from the adapter).
"""

from __future__ import annotations

from typing import List, Optional, Set

import pytest
import torch

from conftest import assert_no_leaks, get_model
from lora_adapters import FAMILIES, adapter_dirs, peft_beams, peft_greedy, peft_model
from paged_backend import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "Paged attention splits the key-value cache into blocks so that",
           "Hi"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-adapters")


def lora_requests(family: str, root) -> List[LoRARequest]:
    return [LoRARequest(f"{family}-{i}", i + 1, str(d)) for i, d in enumerate(adapter_dirs(family, root))]


def prompt_ids(family: str, dtype: torch.dtype) -> List[List[int]]:
    tok = get_model(family, dtype)[1]
    return [tok(p).input_ids for p in PROMPTS]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def reference(family: str, dtype: torch.dtype, lora: Optional[LoRARequest], ids: List[int],
              max_tokens: int = MAX_TOKENS) -> List[int]:
    return peft_greedy(family, dtype, None if lora is None else lora.lora_path, ids, max_tokens)


def record_step_adapters(llm: LLM) -> List[Set[int]]:
    """Wrap the runner: for every step, the adapter slots its tokens used (-1: the base model)."""
    seen: List[Set[int]] = []
    execute = llm.engine.runner.execute

    def recording(inputs):
        if inputs.num_tokens:
            seen.append({-1} if inputs.lora is None else set(inputs.lora.token_slots.tolist()))
        return execute(inputs)

    llm.engine.runner.execute = recording
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_alone_and_in_one_mixed_batch_equals_peft(family, dtype, adapters_root):
    model, tok = get_model(family, dtype)
    loras = lora_requests(family, adapters_root)
    ids = prompt_ids(family, dtype)
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=3, max_lora_rank=8, num_blocks=64, block_size=8)
    for lora in loras:                                           # each adapter alone
        outs = llm.generate(ids, greedy(), use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == [reference(family, dtype, lora, p) for p in ids], lora
    steps = record_step_adapters(llm)
    batch = [(p, lora) for p in ids for lora in [None] + loras]  # the base model and three adapters together
    outs = llm.generate([p for p, _ in batch], greedy(), use_tqdm=False, lora_request=[lo for _, lo in batch])
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == [reference(family, dtype, lora, p) for p, lora in batch]
    assert len({tuple(t) for t in tokens}) == len(tokens), "an adapter that changes nothing proves nothing"
    assert {-1, 0, 1, 2} in steps, f"no step ran the base model and three adapters together: {steps}"
    assert llm.engine.runner.lora.mode == "dense"
    assert_no_leaks(llm.engine)


def test_the_grouped_path_for_many_slot_columns_equals_peft(dtype, adapters_root):
    """Slots whose stacked ranks are many columns (3 x 128) take the grouped per-adapter matmuls: same tokens."""
    family = "tiny-llama"
    model, tok = get_model(family, dtype)
    loras = [None] + lora_requests(family, adapters_root)
    ids = prompt_ids(family, dtype)
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=3, max_lora_rank=128, num_blocks=64, block_size=8)
    assert llm.engine.runner.lora.mode == "grouped"
    batch = [(p, lora) for p in ids for lora in loras]
    outs = llm.generate([p for p, _ in batch], greedy(), use_tqdm=False, lora_request=[lo for _, lo in batch])
    assert [o.outputs[0].token_ids for o in outs] == [reference(family, dtype, lora, p) for p, lora in batch]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_per_adapter_equals_peft(family, dtype, adapters_root):
    model, tok = get_model(family, dtype)
    loras = [None] + lora_requests(family, adapters_root)
    ids = prompt_ids(family, dtype)[:2]
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=3, max_lora_rank=8, num_blocks=128, block_size=8)
    params = SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=8)
    batch = [(p, lora) for p in ids for lora in loras]
    outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora_request=[lo for _, lo in batch])
    tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    for (p, lora), out in zip(batch, outs):
        ref_tokens, ref_scores = peft_beams(family, dtype, None if lora is None else lora.lora_path, p, 3, 8)
        assert [c.token_ids for c in out.outputs] == ref_tokens, lora
        for c, score in zip(out.outputs, ref_scores):
            assert abs(c.beam_score - score) < tolerance
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_under_memory_pressure_equals_peft(family, mode, dtype, adapters_root):
    """Greedy rows, rows with two forked samples (top_k=1 makes them greedy) and beams of three adapters and the
    base model, in a cache too small for them: requests are preempted and come back with their adapter."""
    model, tok = get_model(family, dtype)
    loras = [None] + lora_requests(family, adapters_root)
    ids = prompt_ids(family, dtype)[:2]
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=3, max_lora_rank=8, num_blocks=14, block_size=4,
              preemption_mode=mode, num_swap_blocks=64)
    forked = SamplingParams(n=2, temperature=1.0, top_k=1, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    beams = SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=6)
    batch = [(p, lora, params) for p in ids for lora in loras for params in (greedy(), forked)]
    batch += [(ids[0], lora, beams) for lora in loras]
    outs = llm.generate([b[0] for b in batch], [b[2] for b in batch], use_tqdm=False,
                        lora_request=[b[1] for b in batch])
    stats = llm.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    for (p, lora, params), out in zip(batch, outs):
        if params is beams:
            ref_tokens, _ = peft_beams(family, dtype, None if lora is None else lora.lora_path, p, 2, 6)
            assert [c.token_ids for c in out.outputs] == ref_tokens, (lora, "beams")
        else:
            assert [c.token_ids for c in out.outputs] == [reference(family, dtype, lora, p)] * params.n, lora
    assert_no_leaks(llm.engine)


def test_more_adapters_than_slots_run_in_turns_and_swap_in_lru(dtype, adapters_root):
    """One device slot and one host copy for three adapters: a step never mixes two adapters, every adapter is
    moved in again when its turn comes (and read from disk again), and every token is still PEFT's."""
    family = "tiny-llama"
    model, tok = get_model(family, dtype)
    loras = [None] + lora_requests(family, adapters_root)
    ids = prompt_ids(family, dtype)
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              num_blocks=64, block_size=8)
    steps = record_step_adapters(llm)
    batch = [(p, lora) for lora in loras for p in ids] + [(ids[0], loras[1])]   # adapter 1 comes back at the end
    outs = llm.generate([p for p, _ in batch], greedy(), use_tqdm=False, lora_request=[lo for _, lo in batch])
    assert [o.outputs[0].token_ids for o in outs] == [reference(family, dtype, lora, p) for p, lora in batch]
    assert all(len(s - {-1}) <= 1 for s in steps), steps
    assert any(s == {-1, 0} for s in steps), "the base model runs beside the adapter of the slot"
    stats = llm.get_stats()
    assert stats.num_lora_loads >= 3
    assert llm.engine.loras.num_disk_loads >= 3   # one host copy: the adapters were read again in turn
    assert llm.list_loras() and len(llm.list_loras()) == 1
    assert_no_leaks(llm.engine)


def test_a_shared_prompt_under_two_adapters_never_shares_kv(dtype, adapters_root):
    """Requests with the same long prompt: under the same adapter (or both on the base model) they share the
    prompt's cached blocks; under two adapters, or an adapter and the base model, not one block, and each gets
    its own adapter's tokens."""
    family = "tiny-llama"
    model, tok = get_model(family, dtype)
    first, second = lora_requests(family, adapters_root)[:2]
    prompt = tok("A shared system prompt that many requests start with, long enough to fill several KV "
                 "blocks of eight tokens each, and then a question").input_ids
    assert len(prompt) >= 24
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64, block_size=8)

    def run(lora):
        before = llm.get_stats().prefix_cache_hits
        out = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == reference(family, dtype, lora, prompt), lora
        return llm.get_stats().prefix_cache_hits - before

    assert run(first) == 0
    assert run(second) == 0       # the same tokens under another adapter: no hit
    assert run(None) == 0         # nor for the base model
    assert run(first) == len(prompt) // 8       # the same adapter again: every full block hits
    assert run(None) == len(prompt) // 8
    assert_no_leaks(llm.engine)


def test_token_constraints_and_grammars_run_under_the_adapter(adapters_root):
    """Constrained requests keep their adapter: with allowed_token_ids the greedy token is the adapter's best
    allowed one, and under a `choice` grammar the first token is the adapter's best among the tokens that start
    a choice."""
    family, dtype = "tiny-llama", torch.float64
    model, tok = get_model(family, dtype)
    loras = lora_requests(family, adapters_root)
    words = [" cat", " dog", " sun", " moon", " tree", " car", " red", " blue", " one", " two", " yes", " no"]
    allowed_ids = sorted({tok(w, add_special_tokens=False).input_ids[0] for w in words})
    starts = [t for t in range(len(tok)) if tok.decode([t]) and any(w.startswith(tok.decode([t])) for w in words)]
    ids = prompt_ids(family, dtype)[0]
    llm = LLM(model, tokenizer=tok, enable_lora=True, max_loras=3, max_lora_rank=8, num_blocks=64)
    picks = []
    for lora in [None] + loras:
        reference_model = model if lora is None else peft_model(family, dtype, lora.lora_path)
        with torch.no_grad():
            logits = reference_model(input_ids=torch.tensor([ids])).logits[0, -1]
        best = allowed_ids[int(torch.argmax(logits[allowed_ids]))]
        allowed = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed_ids),
                               use_tqdm=False, lora_request=lora)[0]
        assert allowed.outputs[0].token_ids == [best], lora
        chosen = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, structured_outputs={"choice": words}),
                              use_tqdm=False, lora_request=lora)[0]
        assert chosen.outputs[0].text in words
        assert chosen.outputs[0].token_ids[0] == starts[int(torch.argmax(logits[starts]))], lora
        picks.append(best)
    assert len(set(picks)) > 1, "the adapters must change the pick for this test to mean anything"
    assert_no_leaks(llm.engine)
