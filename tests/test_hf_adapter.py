"""`paged_backend.adapters.hf`: generate through the paged engine is token-identical to transformers' own
generate (float64 tiny models, float32 SmolLM2), with the same output classes, shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_MODELS, assert_no_leaks, get_model
from hf_compare import assert_same_output, hf_generate, left_padded
from paged_backend.adapters.hf import attach, detach

PAD = 2
NEW = 8


@pytest.fixture(params=TINY_MODELS)
def tiny(request):
    model, tok = get_model(request.param, torch.float64)
    attach(model, tokenizer=tok, num_blocks=256, block_size=8)
    try:
        yield model, tok, TINY_MODELS.index(request.param)
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


def both(model, enc, **kwargs):
    """(transformers' result, the paged engine's result) for the same call."""
    return hf_generate(model, **enc, **kwargs), model.generate(**enc, **kwargs)


def test_left_padded_greedy_batch_with_scores(tiny):
    model, tok, which = tiny
    enc = left_padded(tok)
    assert int(enc.attention_mask.sum(1).min()) < enc.input_ids.shape[1]  # the batch really is padded
    ref, out = both(model, enc, max_new_tokens=NEW)
    assert_same_output(ref, out)
    steps = model.paged_engine.get_stats().num_steps
    ref, out = both(model, enc, max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True,
                    output_logits=True)
    assert_same_output(ref, out, enc.input_ids.shape[1], PAD)
    # continuous batching: the rows advance together, one engine step per new token
    assert model.paged_engine.get_stats().num_steps - steps == NEW


def test_beams_with_num_return_sequences(tiny):
    model, tok, which = tiny
    enc = left_padded(tok)
    variants = (dict(num_beams=3, num_return_sequences=2),
                dict(num_beams=4, num_return_sequences=4, length_penalty=0.0, early_stopping=True),
                dict(num_beams=2, num_return_sequences=2, length_penalty=2.0, early_stopping="never"))
    kwargs = variants[which % len(variants)]
    ref, out = both(model, enc, max_new_tokens=NEW, **kwargs)
    assert_same_output(ref, out)
    ref, out = both(model, enc, max_new_tokens=NEW, return_dict_in_generate=True, output_scores=which % 2 == 0,
                    output_logits=True, **kwargs)
    assert_same_output(ref, out)


def _eos_firing_midway(model, enc):
    """A token that greedy decoding emits early in row 0 but never in row 1."""
    greedy = hf_generate(model, **enc, max_new_tokens=NEW, eos_token_id=None)[:, enc.input_ids.shape[1]:]
    for token in greedy[0, 1:5].tolist():
        if token not in greedy[1].tolist() and token != PAD:
            return token
    pytest.fail("no suitable EOS candidate in the greedy output")


def test_eos_firing_midway_pads_finished_rows(tiny):
    model, tok, which = tiny
    enc = left_padded(tok)
    eos = _eos_firing_midway(model, enc)
    ref, out = both(model, enc, max_new_tokens=NEW, eos_token_id=eos)
    assert_same_output(ref, out)
    generated = out[:, enc.input_ids.shape[1]:]
    stop = generated[0].tolist().index(eos)
    assert stop < NEW - 1 and set(generated[0, stop + 1:].tolist()) == {PAD}  # padding after EOS
    assert eos not in generated[1].tolist()
    with pytest.warns(UserWarning, match="finished"):  # rows after EOS have no scores in the engine
        ref, out = both(model, enc, max_new_tokens=NEW, eos_token_id=[eos, PAD], return_dict_in_generate=True,
                        output_scores=True)
    assert_same_output(ref, out, enc.input_ids.shape[1], PAD)


def test_min_new_tokens_masks_eos(tiny):
    model, tok, which = tiny
    enc = left_padded(tok)
    eos = _eos_firing_midway(model, enc)
    if which % 2:
        ref, out = both(model, enc, max_new_tokens=NEW, min_new_tokens=6, eos_token_id=eos)
    else:
        ref, out = both(model, enc, max_new_tokens=NEW, min_length=enc.input_ids.shape[1] + 6, eos_token_id=[eos])
    assert_same_output(ref, out)
    assert eos not in out[0, enc.input_ids.shape[1]:][:6].tolist()  # masked (plain greedy emits it within 5)


def test_repetition_penalty(tiny):
    model, tok, which = tiny
    enc = left_padded(tok)
    ref, out = both(model, enc, max_new_tokens=NEW, repetition_penalty=(0.7, 1.3, 2.0, 0.5)[which])
    assert_same_output(ref, out)
    assert not torch.equal(out, hf_generate(model, **enc, max_new_tokens=NEW))  # the penalty changed something
    ref, out = both(model, enc, max_new_tokens=6, repetition_penalty=1.5, num_beams=2, num_return_sequences=2)
    assert_same_output(ref, out)


def test_stop_strings(tiny):
    model, tok, which = tiny
    enc = left_padded(tok)
    plain = hf_generate(model, **enc, max_new_tokens=NEW)[:, enc.input_ids.shape[1]:]
    text = tok.decode(plain[0, :5])
    stop = text[len(tok.decode(plain[0, :3])):].strip()[:3] or text.strip()[-3:]
    assert stop
    ref, out = both(model, enc, max_new_tokens=NEW, stop_strings=[stop, "zzzz"], tokenizer=tok)
    assert_same_output(ref, out)
    assert stop in tok.decode(out[0, enc.input_ids.shape[1]:])
    assert (out[0, enc.input_ids.shape[1]:] == PAD).any()  # the row was cut by the stop string and padded


def test_smollm2_float32_real_prompts(smollm2):
    model, tok = smollm2
    prompts = ["The capital of France is", "Here is a short poem about the sea:\n",
               "def fibonacci(n):", "Q: What is 12 plus 7?\nA:"]
    enc = left_padded(tok, prompts)
    attach(model, tokenizer=tok, kv_cache_memory="64MiB", block_size=16)
    try:
        ref, out = both(model, enc, max_new_tokens=16)
        assert_same_output(ref, out)
        ref, out = both(model, enc, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
        # float32: padded (transformers) and unpadded (paged) prompts give logits that differ in the last bits
        assert_same_output(ref, out, enc.input_ids.shape[1], tok.pad_token_id, tolerance=2e-3)
        ref, out = both(model, {k: v[:1] for k, v in enc.items()}, max_new_tokens=8, num_beams=3,
                        num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
        assert_same_output(ref, out, tolerance=2e-3)
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


@pytest.mark.parametrize("kwargs", [{}, {"top_p": 0.9}, {"repetition_penalty": 1.3}, {"min_new_tokens": 4}],
                         ids=["defaults", "top_p", "repetition", "min_new_tokens"])
def test_sampling_with_transformers_defaults_in_float32(kwargs):
    """`generate(do_sample=True)` with transformers' defaults (top_k 50, temperature 1) on a float32 model,
    which once failed in the sampler."""
    model, tok = get_model("tiny-llama", torch.float32)
    attach(model, tokenizer=tok, num_blocks=64, block_size=8)
    try:
        enc = left_padded(tok)
        out = model.generate(**enc, do_sample=True, max_new_tokens=6, pad_token_id=PAD, **kwargs)
        prompt_len = enc.input_ids.shape[1]
        assert out.shape[0] == enc.input_ids.shape[0] and prompt_len < out.shape[1] <= prompt_len + 6
        assert torch.equal(out[:, :prompt_len], enc.input_ids)
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)
