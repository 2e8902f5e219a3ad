"""Sampling: parallel samples share blocks, seeds reproduce, distributions match, stops and penalties."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLM, SamplingParams

PROMPT = "Once upon a time in a land far away, there was a small village where"


def make_llm(name="tiny-llama", *, dtype, **options):
    model, tok = get_model(name, dtype)
    options.setdefault("num_blocks", 128)
    return LLM(model, tokenizer=tok, **options)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=-0.5),
    SamplingParams(temperature=1.0, min_tokens=3, n=2), SamplingParams(temperature=0, repetition_penalty=1.1),
], ids=["top_p", "top_k", "min_p", "repetition", "presence", "frequency", "min_tokens", "greedy_penalty"])
def test_ordinary_settings_generate(params, dtype):
    """Every ordinary setting runs to completion in both dtypes (float32 once crashed on in-place edits)."""
    llm = make_llm(dtype=dtype)
    out = llm.generate([PROMPT, "Hi"], params.replace(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(o.error is None and all(len(c.token_ids) == 6 for c in o.outputs) for o in out)
    assert_no_leaks(llm.engine)


def test_parallel_samples_share_prompt_blocks(dtype):
    prompt = PROMPT + " the"
    # a partly filled last block to copy on write
    assert len(get_model("tiny-llama", dtype)[1](prompt).input_ids) % 8
    shared = make_llm(block_size=8, dtype=dtype)
    out = shared.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=1),
                          use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 12 for c in out.outputs)
    separate = make_llm(block_size=8, dtype=dtype)
    separate.generate([prompt] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1),
                      use_tqdm=False)
    assert shared.get_stats().peak_used_blocks < separate.get_stats().peak_used_blocks
    assert shared.get_stats().num_copy_on_write > 0
    assert_no_leaks(shared.engine)


def test_seeded_sampling_in_float64_equals_the_request_alone():
    """docs/architecture.md: with a float64 model a seeded request's tokens equal those it gets alone, whatever
    shares its batch (other prompts, unseeded and seeded neighbours, another engine seed), and its
    log-probabilities agree to rounding."""
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True, logprobs=2,
                            presence_penalty=0.3)
    alone = make_llm(dtype=torch.float64).generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    others = [SamplingParams(temperature=1.2, max_tokens=15, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, top_k=30, seed=5, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    prompts = ["Hello", PROMPT, "Another prompt, a longer one than the first " * 3, "Short"]
    batch = make_llm(seed=99, dtype=torch.float64).generate(prompts, [others[0], params, others[1], others[2]],
                                                            use_tqdm=False)[1].outputs[0]
    assert batch.token_ids == alone.token_ids
    assert abs(batch.cumulative_logprob - alone.cumulative_logprob) < 1e-12
    for got, want in zip(batch.logprobs, alone.logprobs, strict=True):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-12 for t in got)


def test_a_seeded_rows_draws_depend_on_its_logits_alone(dtype):
    """What holds in float32 too: given the same logits row, a seeded row's tokens, log-probabilities and
    generator state do not depend on the other rows of the step (their number, order, settings or failure).
    A float32 model's logits themselves change in their last bits with the batch (docs/architecture.md)."""
    from paged_backend.sampling.sampler import SampleRequest, Sampler
    from paged_backend.core.sequence import Sequence

    vocab = 500
    gen = torch.Generator().manual_seed(8)
    row = (torch.randn(vocab, generator=gen, dtype=torch.float64) * 3).to(dtype)
    seeded = SamplingParams(n=2, temperature=0.8, top_p=0.95, top_k=60, presence_penalty=0.5, seed=21, logprobs=3)

    def draw(neighbours):
        params = [seeded] + [p for p, _ in neighbours]
        rows = torch.stack([row] + [r for _, r in neighbours])
        seqs = [Sequence([1, 2, 3]) for _ in params]
        for seq in seqs:
            seq.token_ids += [7, 9]
        requests = [SampleRequest(p, s, p.n, torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
                    for p, s in zip(params, seqs)]
        result = Sampler(seed=len(neighbours)).sample(rows, requests)[0]
        return result.token_ids, result.logprobs, result.top_logprobs, requests[0].generator.get_state()

    def noise(seed):
        return torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)

    nan_row = torch.full((vocab,), float("nan"), dtype=dtype)
    alone = draw([])
    for neighbours in ([(SamplingParams(temperature=1.0), noise(1))],
                       [(SamplingParams(temperature=0), noise(2)), (SamplingParams(n=3, temperature=1.5, seed=4,
                                                                                  min_p=0.1), noise(3))],
                       [(SamplingParams(temperature=1.0, repetition_penalty=1.4), noise(4)),
                        (SamplingParams(temperature=1.0), nan_row)]):
        got = draw(neighbours)
        assert got[:3] == alone[:3] and torch.equal(got[3], alone[3])


def test_seeded_sampling_is_reproducible(dtype):
    """The same requests in the same batch give the same tokens, run after run (float32 included)."""
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True, n=3)
    others = SamplingParams(temperature=1.2, max_tokens=15, ignore_eos=True, seed=3)
    runs = [make_llm(dtype=dtype).generate(["Hello", PROMPT], [others, params], use_tqdm=False) for _ in range(2)]
    assert [[c.token_ids for c in o.outputs] for o in runs[0]] == [[c.token_ids for c in o.outputs] for o in runs[1]]


def test_top_k_one_equals_greedy(dtype):
    greedy = make_llm(dtype=dtype).generate([PROMPT, "Hi"], SamplingParams(temperature=0, max_tokens=10,
                                                                          ignore_eos=True), use_tqdm=False)
    top1 = make_llm(dtype=dtype).generate([PROMPT, "Hi"], SamplingParams(temperature=1.3, top_k=1, max_tokens=10,
                                                              ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def _first_token_probs(model, tok, prompt, top_k, temperature):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float() / temperature
    values, index = logits.topk(top_k)
    return dict(zip(index.tolist(), values.softmax(-1).tolist()))


@pytest.mark.parametrize("top_k, temperature", [(6, 1.0), (4, 0.5)])
def test_first_token_frequencies_match_softmax(top_k, temperature, dtype):
    model, tok = get_model("tiny-llama", dtype)
    expected = _first_token_probs(model, tok, PROMPT, top_k, temperature)
    llm = make_llm(max_num_seqs=256, seed=7, dtype=dtype)
    draws = 2000
    params = SamplingParams(n=200, temperature=temperature, top_k=top_k, max_tokens=1)
    outs = llm.generate([PROMPT] * (draws // 200), params, use_tqdm=False)
    counts = {t: 0 for t in expected}
    for out in outs:
        for c in out.outputs:
            counts[c.token_ids[0]] += 1  # a KeyError here means a token outside the top-k was drawn
    chi2 = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    critical = {5: 20.52, 3: 16.27}[top_k - 1]  # chi-square 0.999 quantile for top_k - 1 degrees of freedom
    assert chi2 < critical, (chi2, counts, expected)
    assert_no_leaks(llm.engine)


def test_top_p_and_min_p_keep_only_the_nucleus(dtype):
    model, tok = get_model("tiny-llama", dtype)
    probs = _first_token_probs(model, tok, PROMPT, len(tok), 1.0)
    ranked = sorted(probs.items(), key=lambda kv: -kv[1])
    nucleus, total = set(), 0.0
    for token, p in ranked:
        nucleus.add(token)
        total += p
        if total >= 0.3:
            break
    outs = make_llm(dtype=dtype).generate([PROMPT] * 5, SamplingParams(n=40, top_p=0.3, max_tokens=1),
                                          use_tqdm=False)
    assert {c.token_ids[0] for o in outs for c in o.outputs} <= nucleus
    top_prob = ranked[0][1]
    allowed = {t for t, p in probs.items() if p >= 0.5 * top_prob}
    outs = make_llm(dtype=dtype).generate([PROMPT] * 5, SamplingParams(n=40, min_p=0.5, max_tokens=1),
                                          use_tqdm=False)
    assert {c.token_ids[0] for o in outs for c in o.outputs} <= allowed


def test_repetition_penalty_matches_hf(dtype):
    model, tok = get_model("tiny-gpt2", dtype)
    llm = make_llm("tiny-gpt2", dtype=dtype)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=16,
                                                ignore_eos=True), use_tqdm=False)[0]
    ids = tok(PROMPT, return_tensors="pt")
    ref = model.generate(**ids, do_sample=False, repetition_penalty=1.5, max_new_tokens=16, min_new_tokens=16)
    assert out.outputs[0].token_ids == ref[0, ids.input_ids.shape[1]:].tolist()


def test_frequency_and_presence_penalties_discourage_repeats(dtype):
    llm = make_llm("tiny-opt", dtype=dtype)
    plain = llm.generate(["1 1 1 1"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    penalized = llm.generate(["1 1 1 1"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                         presence_penalty=2.0, frequency_penalty=2.0),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalized)) > len(set(plain))


def test_stop_strings_and_stop_tokens(dtype):
    llm = make_llm(dtype=dtype)
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[6:10]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, stop=[stop, "never here"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]
    third = free.token_ids[2]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[third]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:3] and out.stop_reason == third and out.finish_reason == "stop"
    assert_no_leaks(llm.engine)


def test_min_tokens_masks_stop_tokens_and_max_tokens_limits(dtype):
    llm = make_llm(dtype=dtype)
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 5
    first = free.token_ids[0]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first]
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, min_tokens=2,
                                                 stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert held.token_ids[0] != first and len(held.token_ids) >= 2


def test_eos_stops_unless_ignored(dtype):
    model, tok = get_model("tiny-llama", dtype)
    llm = make_llm(dtype=dtype)
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    llm.engine.eos_token_ids[:] = [free.token_ids[1]]  # pretend the second token is EOS (one list, shared)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:2] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids


def test_logprobs_are_log_softmax_of_the_step(dtype):
    model, tok = get_model("tiny-llama", dtype)
    out = make_llm(dtype=dtype).generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                                                 ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3 and all(len(d) == 4 for d in out.logprobs)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(ids).logits[0, -1].float().log_softmax(-1)
    first = out.token_ids[0]
    assert math.isclose(out.logprobs[0][first], float(expected[first]), abs_tol=1e-5)
    assert max(out.logprobs[0], key=out.logprobs[0].get) == first
    assert math.isclose(out.cumulative_logprob, sum(d[t] for d, t in zip(out.logprobs, out.token_ids)),
                        abs_tol=1e-6)


def test_cumulative_logprob_is_reported_only_when_logprobs_are_asked_for(dtype):
    """vLLM v1's contract: `cumulative_logprob` is None unless the request sets `logprobs` (0 is enough), so that a
    greedy step need not compute every row's log-normaliser; asking for it changes no token."""
    llm = make_llm(dtype=dtype)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=7)
    outs = llm.generate([PROMPT] * 4, [greedy, greedy.replace(logprobs=0), sampled, sampled.replace(logprobs=0)],
                        use_tqdm=False)
    plain, asked, plain_sampled, asked_sampled = (o.outputs[0] for o in outs)
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert plain_sampled.cumulative_logprob is None
    assert plain.token_ids == asked.token_ids and plain_sampled.token_ids == asked_sampled.token_ids
    for out in (asked, asked_sampled):
        assert [list(d) for d in out.logprobs] == [[t] for t in out.token_ids]
        assert math.isclose(out.cumulative_logprob, sum(d[t] for d, t in zip(out.logprobs, out.token_ids)),
                            abs_tol=1e-6)
    assert_no_leaks(llm.engine)


def test_a_plain_greedy_step_skips_the_log_normalisers(dtype, monkeypatch):
    """The greedy pass over a step's logits takes each row's maximum only when no row reports log-probabilities
    (the log-normaliser is most of the pass on a CPU); a row that asks for them gets them."""
    from paged_backend import kernels

    calls = []
    real, tokens_only = kernels.greedy_rows, kernels.greedy_tokens

    def recording(logits, with_norms=True, *args, **kwargs):
        calls.append(with_norms)
        return real(logits, with_norms, *args, **kwargs)

    def recording_tokens(logits):   # the GPU's path (`pytest --device-fill`): maxima only, by construction
        calls.append(False)
        return tokens_only(logits)

    monkeypatch.setattr(kernels, "greedy_rows", recording)
    monkeypatch.setattr(kernels, "greedy_tokens", recording_tokens)
    llm = make_llm(dtype=dtype)
    llm.generate([PROMPT, "Hi"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert calls and not any(calls)


def test_best_of_returns_the_most_likely_samples(dtype):
    out = make_llm(dtype=dtype).generate([PROMPT], SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=6,
                                                       ignore_eos=True, seed=3), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_detokenize_off_keeps_tokens_and_skips_text(dtype):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with_text = make_llm(dtype=dtype).generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    ids_only = make_llm(dtype=dtype).generate([PROMPT], params.replace(detokenize=False),
                                              use_tqdm=False)[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == "" and with_text.text
    beams = make_llm(dtype=dtype).generate([PROMPT], SamplingParams(beam_width=2, temperature=0, max_tokens=4,
                                                         detokenize=False), use_tqdm=False)[0].outputs[0]
    assert beams.text == "" and len(beams.token_ids) == 4
