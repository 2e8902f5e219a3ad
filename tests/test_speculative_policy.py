"""The adaptive-k rule of speculative decoding (issue 25, docs/speculative.md): k shrinks with the batch and the
measured acceptance rate, speculation stops above `disable_by_batch_size`, and a proposer that finds nothing
backs off."""

from __future__ import annotations

import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLMEngine, SamplingParams
from paged_backend.engine.spec_decode.policy import MAX_BACKOFF, SpecPolicy, drafts_for_rate


def test_k_shrinks_with_the_batch_and_stops_above_the_limit():
    policy = SpecPolicy(num_speculative_tokens=5, disable_by_batch_size=32)
    assert [policy.num_tokens(b) for b in (1, 8, 16, 21, 32, 33)] == [5, 5, 3, 2, 1, 0]


def test_k_follows_each_sequences_acceptance_rate():
    policy = SpecPolicy(num_speculative_tokens=8, disable_by_batch_size=32)
    assert policy.num_tokens_for(7, 8) == 8            # nothing measured yet
    policy.observe(7, drafted=8, accepted=0)
    assert policy.rates[7] == 0.5 and policy.num_tokens_for(7, 8) == 2   # 0.5 ** 2 >= 1/4 > 0.5 ** 3
    policy.observe(7, drafted=2, accepted=0)
    assert policy.num_tokens_for(7, 8) == 1            # a sequence that stopped copying: one draft
    for _ in range(3):
        policy.observe(7, drafted=1, accepted=1)
    assert policy.rates[7] > 0.8 and policy.num_tokens_for(7, 8) >= 6    # back after three accepted steps
    assert policy.num_tokens_for(8, 8) == 8            # another sequence is not affected
    assert drafts_for_rate(0.75, 8) == 4 and drafts_for_rate(0.0, 8) == 1 and drafts_for_rate(1.0, 8) == 8
    policy.forget([7])
    assert 7 not in policy.rates


def test_steps_without_proposals_back_off():
    policy = SpecPolicy(num_speculative_tokens=4, disable_by_batch_size=32)
    skipped = []
    for _ in range(8):
        policy.proposed(False)
        skipped.append(policy.skip)
        while policy.skip:
            assert policy.num_tokens(1) == 0
            policy.tick()
    assert skipped == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    policy.proposed(True)
    assert policy.skip == 0 and policy.num_tokens(1) == 4
    policy.proposed(False)
    assert policy.skip == 1


class EveryTime:
    """Proposes k copies of the last token for every sequence (a random model rarely repeats itself)."""

    def propose(self, seqs, max_tokens, temperatures=()):
        return [[seq.token_ids[-1]] * k for seq, k in zip(seqs, max_tokens)]

    def draft_probs(self, seq_id):
        return None

    def release(self, seq_ids):
        return None

    def shutdown(self):
        return None


def test_a_batch_above_the_limit_does_not_speculate_and_overlaps():
    """With more running sequences than `disable_by_batch_size`, no step proposes and steps stay overlapped
    (each launches the next before it is processed); below it the same requests speculate."""
    model, tok = get_model("tiny-llama", torch.float32)
    prompt = list(range(30, 40)) * 3
    drafts = {}
    for limit in (2, 8):
        engine = LLMEngine(model, tokenizer=tok, num_blocks=128, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": limit})
        engine.speculator.proposer = EveryTime()
        for i in range(4):
            engine.add_request(str(i), prompt[i:], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        overlapped = 0
        while engine.has_unfinished_requests():
            engine.step()
            overlapped += engine._inflight is not None
        assert_no_leaks(engine)
        drafts[limit] = (engine.get_stats().spec_decode_num_draft_tokens, overlapped)
    assert drafts[2][0] == 0 and drafts[2][1] > 5, drafts
    assert drafts[8][0] > 0, drafts
