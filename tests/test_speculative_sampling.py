"""Speculative decoding of sampled requests follows the target distribution (issue 25, the speculative-sampling
rule): a stand-in runner is a bigram model over 6 tokens with fixed distributions, so every output transition
has a known probability; the transitions of many sampled sequences, with prompt-lookup drafts accepted and
rejected, pass a chi-square test against them, as the plain sampler's do, and a wrong acceptance rule fails
it. Seeded sampled requests stay reproducible."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams
from paged_backend.engine.spec_decode import verifier

VOCAB = 6
# df = VOCAB * (VOCAB - 1) = 30; the chi-square quantile at 1 - 0.001
CHI2_CRITICAL = 59.70


def bigram_logits() -> torch.Tensor:
    """Row c: the logits of the token after token c (peaked differently per row, no token impossible)."""
    gen = torch.Generator().manual_seed(3)
    return torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64) * 1.5


class BigramRunner:
    """A stand-in model runner: the logits of a row depend only on its input token."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def execute(self, inputs):
        if inputs.num_tokens == 0:
            return torch.empty(0, 0)
        return self.logits[inputs.input_ids[inputs.sample_indices]].to(torch.float32)

    def shutdown(self) -> None:
        return None


def sample_transitions(spec, num_requests: int = 400, max_tokens: int = 12, seed: int = 0):
    """Counts [prev, next] of the generated tokens of `num_requests` sampled requests, and the engine's stats."""
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=512, block_size=8, max_num_seqs=16, seed=seed,
                       speculative_config=spec)
    logits = bigram_logits()
    engine.runner = BigramRunner(logits)
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), prompt, params)
    finals = run_to_completion(engine)
    assert_no_leaks(engine)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for out in finals.values():
        tokens = [prompt[-1]] + out.outputs[0].token_ids
        for a, b in zip(tokens, tokens[1:]):
            counts[a, b] += 1
    return counts, torch.softmax(logits.to(torch.float32).double(), dim=-1), engine.get_stats()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum(dim=1, keepdim=True) * probs
    return float(((counts - expected) ** 2 / expected).sum())


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_sampled_output_follows_the_target_distribution():
    plain, probs, _ = sample_transitions(None)
    spec, _, stats = sample_transitions(SPEC)
    assert stats.spec_decode_num_draft_tokens > 1000, stats
    assert 0.1 < stats.spec_decode_acceptance_rate < 0.9, stats
    assert chi_square(plain, probs) < CHI2_CRITICAL
    assert chi_square(spec, probs) < CHI2_CRITICAL


def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch):
    """The test can fail: accepting every draft (whatever the target drew) skews the transitions."""
    monkeypatch.setattr(verifier, "num_accepted", lambda drafts, drawn: len(drafts))
    spec, probs, _ = sample_transitions(SPEC, num_requests=150)
    assert chi_square(spec, probs) > CHI2_CRITICAL


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "no-overlap"])
def test_seeded_sampled_requests_are_reproducible_with_speculation(async_scheduling):
    """A seeded sampled request gives the same tokens with speculation on (alone or beside speculating greedy
    requests) as without it."""
    model, tok = get_model("tiny-llama", torch.float64)
    prompt = list(range(20, 36)) * 2
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    outputs = []
    for spec, neighbours in ((None, 0), (SPEC, 0), (SPEC, 3)):
        engine = LLMEngine(model, tokenizer=tok, num_blocks=128, speculative_config=spec,
                           async_scheduling=async_scheduling)
        engine.add_request("seeded", prompt, seeded)
        for i in range(neighbours):
            engine.add_request(f"g{i}", prompt[i:], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        outputs.append(run_to_completion(engine)["seeded"].outputs[0].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


class BigramDraft:
    """A stand-in draft model: draws its guesses from bigram distributions of its own (not the target's) and
    keeps the rows it drew them from (q), as the draft-model proposer does for sampled requests."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(11)
        self.q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64), dim=-1)
        self.generator = torch.Generator().manual_seed(12)
        self.probs = {}

    def propose(self, seqs, max_tokens, temperatures=()):
        out, self.probs = [], {}
        for seq, k in zip(seqs, max_tokens):
            prev, drafts, rows = seq.token_ids[-1], [], []
            for _ in range(k):
                rows.append(self.q[prev])
                prev = int(torch.multinomial(rows[-1], 1, generator=self.generator))
                drafts.append(prev)
            if rows:
                self.probs[seq.seq_id] = torch.stack(rows)
            out.append(drafts)
        return out

    def draft_probs(self, seq_id):
        return self.probs.get(seq_id)

    def release(self, seq_ids):
        return None

    def shutdown(self):
        return None


def sample_with_draft(num_requests: int = 400):
    model, tok = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, tokenizer=tok, num_blocks=512, block_size=8, max_num_seqs=16,
                       speculative_config=SPEC)
    engine.speculator.proposer = BigramDraft()
    logits = bigram_logits()
    engine.runner = BigramRunner(logits)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), [0, 1, 2, 3, 4, 5], params)
    finals = run_to_completion(engine)
    assert_no_leaks(engine)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for out in finals.values():
        tokens = [5] + out.outputs[0].token_ids
        for a, b in zip(tokens, tokens[1:]):
            counts[a, b] += 1
    return counts, torch.softmax(logits.to(torch.float32).double(), dim=-1), engine.get_stats()


def test_drafts_drawn_from_a_distribution_follow_the_target_by_the_rejection_rule():
    """Guesses drawn from a draft distribution q go through min(1, p/q) acceptance and the max(0, p - q) residual:
    the output transitions pass the same chi-square test."""
    counts, probs, stats = sample_with_draft()
    assert stats.spec_decode_num_draft_tokens > 1000 and 0.1 < stats.spec_decode_acceptance_rate < 0.9, stats
    assert chi_square(counts, probs) < CHI2_CRITICAL


def test_resampling_from_p_instead_of_the_residual_fails_the_test(monkeypatch):
    """The test can fail: after a rejection, drawing from p instead of max(0, p - q) over-weights the drafts'
    tokens."""

    def wrong(p, q, drafts, generator=None):
        out = []
        for i, draft in enumerate(drafts):
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(q[i, draft]) < float(p[i, draft]):
                out.append(int(draft))
                continue
            out.append(int(torch.multinomial(p[i], 1, generator=generator)))
            return out
        out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
        return out

    monkeypatch.setattr(verifier, "speculative_sample", wrong)
    counts, probs, _ = sample_with_draft()
    assert chi_square(counts, probs) > CHI2_CRITICAL
