"""`generate` arguments that need logits processors (`logits_processor`, `bad_words_ids`,
`no_repeat_ngram_size`, `suppress_tokens`, `begin_suppress_tokens`, `sequence_bias`,
`prefix_allowed_tokens_fn`) give exactly what transformers' own `generate` gives: token-identical, scores
included, for greedy and beam search on the tiny models in float64 and on SmolLM2 in float32. Every case
first checks that the processors change transformers' output, so an ignored argument cannot pass."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                    RepetitionPenaltyLogitsProcessor)

from conftest import TINY_MODELS, assert_no_leaks, get_model
from hf_compare import assert_same_output, hf_generate, left_padded
from paged_backend.adapters.hf import attach, detach

PAD = 2
NEW = 8


class PaddedRowBias(LogitsProcessor):
    """A user's processor that reads the whole row transformers passes, left padding included: a bias on the
    token (sum of the row's ids + its first id) mod 97."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        target = (input_ids.sum(-1) + input_ids[:, 0]) % 97
        scores = scores.clone()
        scores[rows, target] += 8.0
        return scores


class RecordingPrefix:
    """prefix_allowed_tokens_fn: a per-prompt window of allowed ids (plus the pad/EOS id); records the batch ids
    and the rows it was called with."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []

    def __call__(self, batch_id: int, sent: torch.Tensor) -> List[int]:
        self.calls.append((batch_id, tuple(sent.tolist())))
        start = 100 + 37 * batch_id + int(sent[-1]) % 50
        return list(range(start, start + 40)) + [PAD]


@pytest.fixture(params=TINY_MODELS)
def tiny(request):
    model, tok = get_model(request.param, torch.float64)
    attach(model, tokenizer=tok, num_blocks=256, block_size=8)
    try:
        yield model, tok
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


def _cases(plain: torch.Tensor, other: int) -> Dict[str, dict]:
    """Arguments built from the tokens transformers generates without them (rows 0 and `other`, of another
    prompt), so that each one changes its output."""
    a, b, c = plain[0, 1].item(), plain[0, 2].item(), plain[other, 0].item()
    return {
        "bad_words_ids": dict(bad_words_ids=[[a], [plain[other, 1].item(), plain[other, 2].item()]]),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2, repetition_penalty=0.5),
        "suppress_tokens": dict(suppress_tokens=[a, c]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=plain[:, 0].tolist()),
        "sequence_bias_with_penalty": dict(sequence_bias=[[[a], -8.0], [[c], -8.0], [[a, b], 5.0]],
                                           repetition_penalty=1.3),
        "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=RecordingPrefix()),
        "user_processors": dict(logits_processor=LogitsProcessorList(
            [PaddedRowBias(), RepetitionPenaltyLogitsProcessor(3.0)]), repetition_penalty=1.1, min_new_tokens=3),
        "bad_words_and_min_length": dict(bad_words_ids=[[a]], no_repeat_ngram_size=3, min_new_tokens=5,
                                         eos_token_id=b),
    }


def both(model, enc, **kwargs):
    if "prefix_allowed_tokens_fn" in kwargs:  # one recorder per run, to compare what each saw
        theirs, ours = RecordingPrefix(), RecordingPrefix()
        ref = hf_generate(model, **enc, **{**kwargs, "prefix_allowed_tokens_fn": theirs})
        out = model.generate(**enc, **{**kwargs, "prefix_allowed_tokens_fn": ours})
        assert {b for b, _ in ours.calls} == {b for b, _ in theirs.calls} == set(range(enc.input_ids.shape[0]))
        assert set(ours.calls) <= set(theirs.calls)  # the same (batch id, padded row) pairs; finished rows aside
        return ref, out
    return hf_generate(model, **enc, **kwargs), model.generate(**enc, **kwargs)


SCORED_CASES = ("bad_words_ids", "sequence_bias_with_penalty", "prefix_allowed_tokens_fn", "user_processors")
CASE_NAMES = ["bad_words_ids", "no_repeat_ngram_size", "suppress_tokens", "begin_suppress_tokens",
              "sequence_bias_with_penalty", "prefix_allowed_tokens_fn", "user_processors", "bad_words_and_min_length"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_greedy_equals_transformers(tiny, case):
    model, tok = tiny
    enc = left_padded(tok)
    assert int(enc.attention_mask.sum(1).min()) < enc.input_ids.shape[1]  # padded: processors see the pads
    plain = hf_generate(model, **enc, max_new_tokens=NEW, pad_token_id=PAD)
    kwargs = _cases(plain[:, enc.input_ids.shape[1]:], 1)[case]
    ref, out = both(model, enc, max_new_tokens=NEW, pad_token_id=PAD, **kwargs)
    assert not torch.equal(ref, plain), "the arguments did not change transformers' output: the case tests nothing"
    assert_same_output(ref, out)
    if case in SCORED_CASES:
        ref, out = both(model, enc, max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True,
                        output_scores=True, output_logits=True, **kwargs)
        assert_same_output(ref, out, enc.input_ids.shape[1], PAD)


@pytest.mark.parametrize("case", ["bad_words_ids", "no_repeat_ngram_size", "sequence_bias_with_penalty",
                                  "prefix_allowed_tokens_fn", "user_processors"])
def test_beams_equal_transformers(tiny, case):
    """Beam search applies the processors to log-probabilities, as transformers does."""
    model, tok = tiny
    enc = left_padded(tok)
    beams = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, pad_token_id=PAD)
    plain = hf_generate(model, **enc, **beams)
    kwargs = _cases(plain[:, enc.input_ids.shape[1]:], 2)[case]
    ref, out = both(model, enc, **beams, **kwargs)
    assert not torch.equal(ref, plain)
    assert_same_output(ref, out)
    ref, out = both(model, enc, **beams, return_dict_in_generate=True, output_scores=True, **kwargs)
    assert_same_output(ref, out)


def test_sampled_rows_keep_their_prompts_batch_id():
    """With num_return_sequences, transformers gives every sample its prompt's index as batch id; sampled
    tokens stay inside the allowed windows (float32)."""
    model, tok = get_model("tiny-llama", torch.float32)
    attach(model, tokenizer=tok, num_blocks=128, block_size=8)
    try:
        enc = left_padded(tok)
        prefix = RecordingPrefix()
        torch.manual_seed(0)
        out = model.generate(**enc, do_sample=True, num_return_sequences=2, max_new_tokens=5, pad_token_id=PAD,
                             prefix_allowed_tokens_fn=prefix, suppress_tokens=[PAD])
        assert {b for b, _ in prefix.calls} == {0, 1, 2}
        prompt_len = enc.input_ids.shape[1]
        for row in range(out.shape[0]):
            batch_id = row // 2
            for t in range(prompt_len, out.shape[1]):
                start = 100 + 37 * batch_id + int(out[row, t - 1]) % 50
                assert start <= int(out[row, t]) < start + 40, (row, t)
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


def test_smollm2_float32_processors(smollm2):
    model, tok = smollm2
    enc = left_padded(tok, ["The capital of France is", "def fibonacci(n):"])
    attach(model, tokenizer=tok, kv_cache_memory="64MiB", block_size=16)
    try:
        plain = hf_generate(model, **enc, max_new_tokens=10)
        banned = plain[0, enc.input_ids.shape[1] + 1].item()
        kwargs = dict(max_new_tokens=10, bad_words_ids=[[banned]], no_repeat_ngram_size=2,
                      logits_processor=LogitsProcessorList([PaddedRowBias()]))
        ref, out = both(model, enc, **kwargs)
        assert not torch.equal(ref, plain)
        assert_same_output(ref, out)
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


def test_a_failing_user_processor_fails_the_call_and_frees_its_blocks(tiny):
    model, tok = tiny

    def broken(input_ids, scores):
        raise RuntimeError("processor bug")

    enc = left_padded(tok)
    with pytest.raises(RuntimeError, match="processor bug"):
        model.generate(**enc, max_new_tokens=4, logits_processor=[broken])
    assert model.generate(**enc, max_new_tokens=2).shape[1] == enc.input_ids.shape[1] + 2
