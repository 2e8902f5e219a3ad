"""Speculative decoding (issue 25): `speculative_config` is validated; prompt lookup finds its n-grams; greedy
output is token-identical with speculation on and off, alone and mixed with requests that do not speculate,
under memory pressure (swap and recompute) with prefix caching, with every stop condition; rejected positions
leave no block behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams
from paged_backend.config import EngineConfig
from paged_backend.engine.spec_decode.ngram_proposer import ngram_lookup
from spec_oracle import with_oracle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


# ---- configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ({"method": "ngram", "num_speculative_token": 4}, "num_speculative_token"),
    ({"method": "medusa"}, "medusa"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "model"),
    ("ngram", "dict"),
])
def test_bad_speculative_config_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=value)


def test_speculative_config_reaches_the_engine():
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert (config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_min,
            config.speculative.prompt_lookup_max) == (3, 2, 5)
    only_min = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "prompt_lookup_min": 5}).speculative
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (5, 5)
    only_max = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "prompt_lookup_max": 4}).speculative
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 4)
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=16, speculative_config=NGRAM)
    assert engine.speculator is not None and engine.speculator.policy.k == 4
    assert LLMEngine(model, tokenizer=tok, num_blocks=16).speculator is None


# ---- prompt lookup --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 3, [4, 5, 9]),          # the longest suffix (1 2 3) found earlier
    ([7, 8, 1, 2, 3, 4, 5, 6, 2, 3], 2, [4, 5]),             # "2 3" occurs once before
    ([1, 2, 3], 2, []),                                      # nothing earlier
    ([5, 1, 6, 2, 5, 1, 6, 3, 5, 1], 2, [6, 3]),             # the latest occurrence followed by k tokens
    ([5, 1, 6, 2, 5, 1], 3, [6, 2, 5]),                      # none has k tokens after the latest: the earliest
    ([4, 4, 4, 4], 4, [4]),                                  # the longest suffix (4 4 4) wins
])
def test_ngram_lookup(tokens, k, expected):
    assert ngram_lookup(np.array(tokens), 1, 3, k) == expected


def test_ngram_lookup_respects_the_minimum_size():
    tokens = np.array([1, 2, 9, 8, 7, 6, 2])          # only a 1-gram ("2") occurs earlier
    assert ngram_lookup(tokens, 1, 3, 2) == [9, 8]
    assert ngram_lookup(tokens, 2, 3, 2) == []


# ---- greedy exactness ----------------------------------------------------------------------------------------
PROMPTS = [list(range(10 + i, 26 + 3 * i)) for i in range(3)]


def run(model, tok, requests, spec=None, oracle=None, check=None, first_alone=False, **options):
    """Final outputs of `requests` ((id, prompt, params) in arrival order) and the engine (`first_alone`: the
    others arrive after the first one's first step, so they find its prompt blocks in the prefix cache)."""
    options.setdefault("num_blocks", 128)
    options.setdefault("block_size", 8)
    engine = LLMEngine(model, tokenizer=tok, speculative_config=spec, **options)
    if oracle is not None:
        with_oracle(engine, oracle)
    finals, steps = {}, 0
    for i, (rid, prompt, params) in enumerate(requests):
        engine.add_request(rid, prompt, params)
        if first_alone and i == 0:
            assert not any(out.finished for out in engine.step())
            steps += 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if check is not None:
            check(engine)
        steps += 1
        assert steps < 2000, engine.get_stats()
    assert_no_leaks(engine)
    return finals, engine


def known(requests, finals):
    """The oracle's continuations: each request's output without speculation."""
    return [(prompt, finals[rid].outputs[0].token_ids) for rid, prompt, _ in requests]


def tables_cover_only_known_tokens(engine) -> None:
    """After every step: no table holds a block past its sequence's slots (a rejected position's block freed),
    and no sequence has more blocks in the prefix cache than its known tokens fill."""
    bm = engine.block_manager
    for group in engine.scheduler.running:
        for seq in group.seqs:
            table = bm.block_tables.get(seq.seq_id)
            if table is None or seq.is_finished():
                continue
            assert len(table) <= bm.blocks_for(seq.len_with_pending), (seq, table)
            assert bm._num_registered.get(seq.seq_id, 0) * bm.block_size <= len(seq.token_ids), seq


def assert_same(got, want, dtype, rids=None):
    for rid in rids or want:
        a, b = got[rid], want[rid]
        assert a.error is None and b.error is None, (rid, a.error, b.error)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                (y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
            tolerance = 1e-9 if dtype == torch.float64 else 1e-3
            assert (x.cumulative_logprob is None) == (y.cumulative_logprob is None), rid
            if y.cumulative_logprob is not None:
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=tolerance * len(x.token_ids)), rid
            if y.logprobs:
                for p, q in zip(x.logprobs, y.logprobs, strict=True):
                    assert p.keys() == q.keys(), rid
                    for t in p:
                        assert p[t].logprob == pytest.approx(q[t].logprob, abs=tolerance), rid


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_greedy_output_is_identical_mixed_with_requests_that_do_not_speculate(name, dtype):
    """Three speculating greedy requests (one asking for top logprobs) in one batch with a greedy request that
    gets no proposals, a seeded sampled one, a beam search and a structured-output request: every output is
    what it is without speculation; drafts were accepted and rejected."""
    model, tok = get_model(name, dtype)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [(f"g{i}", p, greedy if i else SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                            logprobs=2))
                for i, p in enumerate(PROMPTS)]
    others = [("plain", list(range(200, 211)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                               logprobs=0)),
              ("sampled", list(range(300, 309)), SamplingParams(temperature=0.8, seed=7, max_tokens=20,
                                                                ignore_eos=True)),
              ("beam", list(range(400, 407)), SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=8)),
              ("json", list(range(500, 506)), SamplingParams(temperature=0, max_tokens=10,
                                                             structured_outputs={"choice": ["yes", "no"]}))]
    want, plain = run(model, tok, requests + others)
    got, engine = run(model, tok, requests + others, NGRAM, oracle=known(requests, want),
                      check=tables_cover_only_known_tokens)
    assert_same(got, want, dtype)
    stats = engine.get_stats()
    # draft tokens count neither as prompt nor as generated tokens until accepted
    assert (stats.num_prompt_tokens, stats.num_generated_tokens) == \
        (plain.get_stats().num_prompt_tokens, plain.get_stats().num_generated_tokens)
    assert stats.spec_decode_num_accepted_tokens > 0, stats
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats
    assert stats.num_steps < max(len(o.outputs[0].token_ids) for o in want.values()) + 2
    assert 0 < stats.spec_decode_acceptance_rate < 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_output_is_identical_under_memory_pressure(mode, dtype):
    """A cache too small for the batch: requests are preempted (by swapping or by recomputation) while they
    speculate, and share prompt prefixes through the prefix cache; outputs are unchanged and no block leaks."""
    model, tok = get_model("tiny-llama", dtype)
    prefix = list(range(50, 66))
    requests = [(f"r{i}", prefix + list(range(100 + 7 * i, 104 + 8 * i)),
                 SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)) for i in range(4)]
    options = dict(num_blocks=22, block_size=4, preemption_mode=mode, num_swap_blocks=64, first_alone=True)
    want, _ = run(model, tok, requests, **options)
    got, engine = run(model, tok, requests, NGRAM, oracle=known(requests, want),
                      check=tables_cover_only_known_tokens, **options)
    assert_same(got, want, dtype)
    stats = engine.get_stats()
    preemptions = stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions
    assert preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert stats.spec_decode_num_accepted_tokens > 0, stats


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "no-overlap"])
def test_stop_conditions_are_checked_at_every_accepted_token(async_scheduling):
    """A stop token, a stop string and max_tokens that fall inside a step's accepted drafts end the request
    there, exactly as without speculation (the tokens after the stop are dropped)."""
    model, tok = get_model("tiny-llama", torch.float64)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    probe, _ = run(model, tok, [("p", PROMPTS[0], base)])
    out = probe["p"].outputs[0]
    stop_id = out.token_ids[9]
    stop_text = tok.decode(out.token_ids[13:15])
    requests = [("stop-id", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                       stop_token_ids=[stop_id])),
                ("stop-str", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                        stop=[stop_text])),
                ("length", PROMPTS[0], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))]
    want, _ = run(model, tok, requests, async_scheduling=async_scheduling)
    oracle = [(PROMPTS[0], out.token_ids)]
    got, engine = run(model, tok, requests, NGRAM, oracle=oracle, async_scheduling=async_scheduling)
    assert_same(got, want, torch.float64)
    assert want["stop-id"].outputs[0].token_ids[-1] == stop_id
    assert want["stop-str"].outputs[0].finish_reason == "stop"
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_prompt_lookup_speeds_up_copying_on_smollm2(smollm2):
    """The real n-gram proposer on a real model asked to repeat a text: most drafts are accepted, the output is
    the same and it takes far fewer steps."""
    model, tok = smollm2
    text = ("The quick brown fox jumps over the lazy dog near the river bank, while the farmer watches from the "
            "old wooden fence.")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat this text exactly:\n\n" + text}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False).input_ids
    requests = [("copy", ids, SamplingParams(temperature=0, max_tokens=24))]
    want, plain = run(model, tok, requests)
    got, engine = run(model, tok, requests, NGRAM)
    assert_same(got, want, torch.float32)
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens >= 6, stats
    assert stats.num_steps * 2 <= plain.get_stats().num_steps, (stats.num_steps, plain.get_stats().num_steps)


# ---- draft model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_draft_model_greedy_output_is_identical(mode, dtype):
    """A draft model over its own paged cache: the target itself as the draft (every draft accepted) and another
    family with the same tokenizer (hardly any accepted), under memory pressure, beside a beam search: outputs are
    unchanged, and both caches are empty at the end."""
    model, tok = get_model("tiny-llama", dtype)
    other, _ = get_model("tiny-opt", dtype)
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    requests.append(("beam", list(range(400, 407)), SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=6)))
    options = dict(num_blocks=24, block_size=4, preemption_mode=mode, num_swap_blocks=64)
    want, _ = run(model, tok, requests, **options)
    for draft, accepted_all in ((model, True), (other, False)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        got, engine = run(model, tok, requests, spec, check=tables_cover_only_known_tokens, **options)
        assert_same(got, want, dtype)
        stats = engine.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0, stats
        if accepted_all:
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, stats
        proposer = engine.speculator.proposer
        assert proposer.num_free_blocks == proposer.pool.num_blocks and not proposer.tracked


def test_draft_model_with_another_vocabulary_or_dtype_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = get_model("tiny-llama", torch.float32)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        LLMEngine(model, tokenizer=tok, num_blocks=16,
                  speculative_config={"method": "draft_model", "model": small})
    other, _ = get_model("tiny-opt", torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine(model, tokenizer=tok, num_blocks=16,
                  speculative_config={"method": "draft_model", "model": other})
    engine = LLMEngine(model, tokenizer=tok, num_blocks=16,
                       speculative_config={"method": "draft_model", "model": "tiny-opt"})
    assert engine.speculator.proposer.pool.num_blocks == 16


def test_lora_requests_speculate_with_their_adapters(tmp_path):
    """Requests with different LoRA adapters and the base model, speculating in one batch: every verified
    position runs its request's adapter, so outputs equal those without speculation."""
    from lora_adapters import adapter_dirs
    from paged_backend import LoRARequest

    model, tok = get_model("tiny-llama", torch.float64)
    loras = [LoRARequest(f"a{i}", i + 1, str(d)) for i, d in enumerate(adapter_dirs("tiny-llama", tmp_path)[:2])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    finals = {}
    for spec in (None, "ngram"):
        engine = LLMEngine(model, tokenizer=tok, num_blocks=128, block_size=8, enable_lora=True, max_loras=2,
                           speculative_config=None if spec is None else NGRAM)
        if spec is not None:
            with_oracle(engine, [(p, finals[None][f"r{i}"].outputs[0].token_ids) for i, p in enumerate(PROMPTS)])
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params, lora_request=([None] + loras)[i])
        finals[spec] = run_to_completion(engine)
        assert_no_leaks(engine)
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_same(finals["ngram"], finals[None], torch.float64)
    assert finals[None]["r1"].outputs[0].token_ids != finals[None]["r0"].outputs[0].token_ids


def test_a_sliding_window_model_refuses_speculation_by_name():
    model, tok = get_model("tiny-mistral", torch.float32)
    with pytest.raises(ValueError, match="sliding window"):
        LLMEngine(model, tokenizer=tok, num_blocks=16, speculative_config=NGRAM)


def test_streamed_deltas_of_accepted_tokens_add_up_to_the_output():
    """A step may append several tokens to a request: its DELTA outputs carry all of them, once."""
    from paged_backend.sampling_params import RequestOutputKind

    model, tok = get_model("tiny-llama", torch.float64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    want, _ = run(model, tok, [("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))])
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, speculative_config=NGRAM)
    with_oracle(engine, [(PROMPTS[0], want["r"].outputs[0].token_ids)])
    engine.add_request("r", PROMPTS[0], params)
    tokens, text, sizes = [], "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            sizes.append(len(out.outputs[0].token_ids))
    assert tokens == want["r"].outputs[0].token_ids and text == want["r"].outputs[0].text
    assert max(sizes) > 1
    assert_no_leaks(engine)


def test_chunked_prompts_speculate_from_their_last_prompt_token():
    """Prompts prefilled in chunks (a small token budget): a sequence whose chunks leave only its last prompt
    token may already verify drafts with it; outputs and token counts are those without speculation."""
    model, tok = get_model("tiny-llama", torch.float64)
    requests = [(f"r{i}", list(range(60 + i, 60 + i + 13)), SamplingParams(temperature=0, max_tokens=16,
                                                                             ignore_eos=True)) for i in range(3)]
    options = dict(max_num_batched_tokens=12, max_num_seqs=3, enable_prefix_caching=False, async_scheduling=False)
    want, plain = run(model, tok, requests, **options)
    got, engine = run(model, tok, requests, NGRAM, oracle=known(requests, want),
                      check=tables_cover_only_known_tokens, **options)
    assert_same(got, want, torch.float64)
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_prompt_tokens == plain.get_stats().num_prompt_tokens == 3 * 13


@pytest.mark.parametrize("async_scheduling, draft", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "no-overlap", "draft-model"])
def test_aborts_between_speculating_steps_leave_no_block_behind(async_scheduling, draft):
    """Requests aborted at random points while others speculate (drafts accepted and rejected): the survivors'
    outputs are unchanged and every block of both pools comes back."""
    import random

    model, tok = get_model("tiny-llama", torch.float64)
    requests = [(f"r{i}", list(range(20 + 5 * i, 38 + 5 * i)), SamplingParams(temperature=0, max_tokens=24,
                                                                                ignore_eos=True)) for i in range(6)]
    want, _ = run(model, tok, requests, async_scheduling=async_scheduling)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3} if draft else NGRAM
    engine = LLMEngine(model, tokenizer=tok, num_blocks=40, block_size=4, speculative_config=spec,
                       async_scheduling=async_scheduling)
    if not draft:
        with_oracle(engine, known(requests, want))
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    rng, finals, aborted = random.Random(5), {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        live = [rid for rid, _, _ in requests if rid not in finals and rid not in aborted]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            aborted.add(victim)
            engine.abort_request(victim)
        tables_cover_only_known_tokens(engine)
    assert aborted and engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_same({rid: finals[rid] for rid in finals if rid not in aborted}, want, torch.float64,
                [rid for rid in finals if rid not in aborted])
    assert_no_leaks(engine)
    if draft:
        proposer = engine.speculator.proposer
        assert proposer.num_free_blocks == proposer.pool.num_blocks and not proposer.tracked


def test_a_draft_model_draws_sampled_guesses_and_its_own_distribution_accepts_them_all():
    """For a sampled request the draft model draws its guesses from softmax(logits / temperature) (q) and the
    rejection rule accepts a guess with min(1, p/q): with the target as its own draft, p == q and every guess
    is accepted; a top-k request (p truncated, q not) still runs to the end, with some rejected."""
    model, tok = get_model("tiny-llama", torch.float64)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    for params, all_accepted in ((SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True), True),
                                 (SamplingParams(temperature=0.8, top_k=3, max_tokens=16, ignore_eos=True), False)):
        engine = LLMEngine(model, tokenizer=tok, num_blocks=64, speculative_config=spec)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        finals = run_to_completion(engine)
        assert_no_leaks(engine)
        assert all(len(out.outputs[0].token_ids) == 16 and out.error is None for out in finals.values())
        stats = engine.get_stats()
        assert stats.spec_decode_num_draft_tokens > 0
        if all_accepted:
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, stats
        else:
            assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats
