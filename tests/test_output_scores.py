"""The engine's per-token scores (`SamplingParams(output_scores=True)`), beam paths and KV release."""

from __future__ import annotations

import weakref

import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams


def test_sampled_tokens_come_with_their_scores_and_logits():
    model, tok = get_model("tiny-llama")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8)
    prompt = tok("Scores for every token").input_ids
    engine.add_request("greedy", prompt, SamplingParams(temperature=0, max_tokens=5, output_scores=True,
                                                        repetition_penalty=1.4))
    engine.add_request("sampled", prompt, SamplingParams(n=2, temperature=0.8, top_k=5, max_tokens=4, seed=3,
                                                         output_scores=True))
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=3))
    finals = run_to_completion(engine)
    greedy = finals["greedy"].outputs[0]
    assert len(greedy.scores) == len(greedy.logits) == len(greedy.token_ids) == 5
    assert [int(s.argmax()) for s in greedy.scores] == greedy.token_ids
    assert all(s.dtype == torch.float32 and s.shape == (model.config.vocab_size,) for s in greedy.scores)
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(greedy.logits[0], first)
    assert not torch.equal(greedy.scores[0], greedy.logits[0])  # the repetition penalty is in the scores
    for sample in finals["sampled"].outputs:
        assert len(sample.scores) == len(sample.token_ids) == 4
        assert all(torch.isfinite(s).sum() == 5 for s in sample.scores)  # top_k=5 leaves five candidates
        assert all(bool(torch.isfinite(s[t])) for s, t in zip(sample.scores, sample.token_ids))
    assert finals["plain"].outputs[0].scores is None and finals["plain"].step_scores is None
    assert_no_leaks(engine)


def test_beam_search_records_live_beam_scores_and_paths():
    model, tok = get_model("tiny-gpt2")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8)
    prompt = tok("Beams keep their history").input_ids
    engine.add_request("beam", prompt, SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=6,
                                                      output_scores=True, length_penalty=0.0))
    out = run_to_completion(engine)["beam"]
    assert [s.shape[0] for s in out.step_scores] == [1] + [3] * (len(out.step_scores) - 1)
    assert len(out.step_logits) == len(out.step_scores)
    for completion in out.outputs:
        assert len(completion.beam_indices) == len(completion.token_ids)
        # the summed scores along the beam's path are its cumulative log-prob (transformers' recipe)
        total = sum(float(out.step_scores[t][beam, token])
                    for t, (beam, token) in enumerate(zip(completion.beam_indices, completion.token_ids)))
        assert abs(total - completion.cumulative_logprob) < 1e-4
        assert abs(completion.beam_score - completion.cumulative_logprob) < 1e-4  # length_penalty=0
    assert_no_leaks(engine)


def test_shutdown_releases_the_kv_cache():
    model, tok = get_model("tiny-opt")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=16, block_size=8)
    kv = weakref.ref(engine.runner.cache_engine.kv)
    engine.shutdown()
    assert kv() is None
