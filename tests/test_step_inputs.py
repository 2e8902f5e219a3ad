"""`StepInputs.to`: a step's inputs moved to the runner's device."""

from __future__ import annotations

import torch

from paged_backend.worker.step_inputs import StepInputs


def _inputs() -> StepInputs:
    n = 3
    return StepInputs(input_ids=torch.tensor([5, 6, 7]), positions=torch.arange(n), slot_mapping=torch.arange(n),
                      block_tables=torch.zeros(1, 1, dtype=torch.int32),
                      context_lens=torch.tensor([n], dtype=torch.int32),
                      query_start_loc=torch.tensor([0, n], dtype=torch.int32), sample_indices=torch.tensor([n - 1]),
                      swap_in={1: 2}, copies=[(3, 4)])


def test_inputs_already_on_the_device_are_returned_as_they_are():
    """A CPU step's inputs stay themselves: no tensor call per field (each one gives the interpreter away on the
    compute thread, where another thread may then keep it for milliseconds)."""
    inputs = _inputs()
    assert inputs.to("cpu") is inputs and inputs.to(torch.device("cpu")) is inputs


def test_inputs_moved_to_another_device_keep_every_field():
    """Moving (here to the meta device, which every build has) gives new tensors and keeps the plain fields."""
    inputs = _inputs()
    moved = inputs.to("meta")
    assert moved is not inputs and moved.input_ids.device.type == "meta"
    assert moved.input_ids.shape == inputs.input_ids.shape and moved.block_tables.dtype == torch.int32
    assert moved.swap_in == {1: 2} and moved.copies == [(3, 4)] and moved.lora is None
