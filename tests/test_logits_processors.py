"""Per-request logits processors (vLLM v0's callables) applied to the rows that have them."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from paged_backend.sampling.logits_processors import (ProcessorRow, apply_logits_processors, check_logits_processors,
                                             takes_prompt)


def ban_last_output(output_ids, logits):
    if output_ids:
        logits[output_ids[-1]] = float("-inf")
    return logits


def boost_prompt(prompt_ids, output_ids, logits):
    out = logits.clone()
    out[prompt_ids] += 100.0 + len(output_ids)
    return out


class Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, output_ids, logits):
        return logits * self.factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_processors_run_in_order_on_their_rows_only(dtype):
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0)).to(dtype)
    original = logits.clone()
    rows = [ProcessorRow(2, [1, 3], [7], [ban_last_output, boost_prompt, Scale(0.5)]),
            ProcessorRow(0, [4], [], [Scale(2.0)])]
    apply_logits_processors(logits, rows)
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[3], original[3])
    assert torch.equal(logits[0], original[0] * 2.0)
    expected = original[2].clone()
    expected[7] = float("-inf")
    expected[[1, 3]] += 101.0
    assert torch.equal(logits[2], expected * 0.5)
    assert logits.dtype == dtype


def test_no_rows_leaves_logits_alone():
    logits = torch.randn(2, 5)
    original = logits.clone()
    assert apply_logits_processors(logits, []) == {}
    assert torch.equal(logits, original)


def test_processors_see_copies_of_the_token_lists():
    seen = []

    def record(prompt_ids, output_ids, logits):
        seen.append((prompt_ids, output_ids))
        prompt_ids.append(99)
        return logits

    prompt, output = (5, 6), [7]
    apply_logits_processors(torch.zeros(1, 3), [ProcessorRow(0, prompt, output, [record])])
    assert seen == [([5, 6, 99], [7])] and output == [7]


def test_signatures():
    assert not takes_prompt(ban_last_output) and takes_prompt(boost_prompt)
    assert not takes_prompt(Scale(1.0)) and not takes_prompt(lambda ids, logits: logits)
    assert takes_prompt(functools.partial(lambda a, b, c, d: d, 1))
    with pytest.raises(ValueError, match="it takes 1 parameters"):
        takes_prompt(lambda logits: logits)
    with pytest.raises(ValueError, match="it takes 4 parameters"):
        takes_prompt(lambda a, b, c, d: d)


def test_check_logits_processors():
    assert check_logits_processors(None) == []
    assert check_logits_processors((ban_last_output,)) == [ban_last_output]
    with pytest.raises(ValueError, match="must be a list of callables"):
        check_logits_processors(ban_last_output)
    with pytest.raises(ValueError, match="is not callable"):
        check_logits_processors([ban_last_output, 3])
    with pytest.raises(ValueError, match="must take"):
        check_logits_processors([lambda x: x])


@pytest.mark.parametrize("bad, got", [(lambda ids, logits: None, "NoneType"),
                                      (lambda ids, logits: logits[:3], r"\[3\]")])
def test_a_processor_must_return_a_row(bad, got):
    """A bad processor fails its own row (named in the result, with the reason); the other rows are processed."""
    logits = torch.zeros(2, 5)
    failures = apply_logits_processors(logits, [ProcessorRow(0, [], [], [bad]), ProcessorRow(1, [], [], [Scale(2.0)])])
    assert list(failures) == [0]
    assert re.search(rf"ValueError: .* must return a tensor of shape \[5\], got {got}", failures[0])


def test_a_processor_that_raises_fails_its_row_alone():
    logits = torch.ones(3, 4)
    rows = [ProcessorRow(0, [], [], [Scale(3.0)]), ProcessorRow(1, [], [], [Scale(2.0), lambda ids, x: 1 / 0]),
            ProcessorRow(2, [], [], [Scale(0.5)])]
    failures = apply_logits_processors(logits, rows)
    assert list(failures) == [1] and "ZeroDivisionError" in failures[1]
    assert torch.equal(logits[0], torch.full((4,), 3.0)) and torch.equal(logits[2], torch.full((4,), 0.5))
