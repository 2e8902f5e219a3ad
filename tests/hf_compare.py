"""Helpers for the Hugging Face adapter tests: transformers' own generate and a field-by-field comparison."""

from __future__ import annotations

import torch

PROMPTS = ["The capital of France is", "Hi", "Once upon a time, in a land far away, there lived"]


def hf_generate(model, *args, **kwargs):
    """transformers' own generate, even while the model is attached."""
    return type(model).generate(model, *args, **kwargs)


def left_padded(tok, prompts=PROMPTS):
    tok.padding_side = "left"
    return tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def _assert_rows_close(name, step, ref, out, pad_rows, tolerance):
    assert ref.shape == out.shape and ref.dtype == out.dtype, (name, step, ref.shape, out.shape, ref.dtype, out.dtype)
    assert ref.device == out.device
    for r in range(out.shape[0]):
        if bool(torch.isinf(out[r]).all()) and not bool(torch.isinf(ref[r]).all()):
            assert r in pad_rows, f"{name}[{step}] row {r} was left blank but the sequence had not finished"
            continue
        torch.testing.assert_close(out[r], ref[r], rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"{name}[{step}] row {r}: {m}")


def assert_same_output(ref, out, prompt_len=None, pad_id=None, tolerance=1e-5):
    """Same type, same fields, same shapes and dtypes; equal tokens; scores equal wherever the engine has
    them (rows of finished sequences may be blank, see docs/hf.md)."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor) and out.dtype == ref.dtype and out.shape == ref.shape, (ref, out)
        assert torch.equal(out, ref), f"\nhf:\n{ref}\npaged:\n{out}"
        return
    assert type(out) is type(ref)
    assert set(out.keys()) == set(ref.keys()) - {"cache"}, (out.keys(), ref.keys())
    assert_same_output(ref.sequences, out.sequences)
    if "beam_indices" in ref:
        assert out.beam_indices.dtype == ref.beam_indices.dtype
        assert torch.equal(out.beam_indices, ref.beam_indices), (ref.beam_indices, out.beam_indices)
    if "sequences_scores" in ref:
        assert out.sequences_scores.dtype == ref.sequences_scores.dtype
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=tolerance, atol=tolerance)
    for name in ("scores", "logits"):
        if name in ref:
            assert isinstance(out[name], tuple) and len(out[name]) == len(ref[name]), name
            for step, (r, o) in enumerate(zip(ref[name], out[name])):
                pad_rows = set()
                if prompt_len is not None and "beam_indices" not in ref:
                    pad_rows = {i for i in range(r.shape[0]) if int(ref.sequences[i, prompt_len + step]) == pad_id}
                elif "beam_indices" in ref:
                    pad_rows = set(range(r.shape[0]))
                _assert_rows_close(name, step, r, o, pad_rows, tolerance)
