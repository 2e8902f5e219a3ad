"""A hole in a block table (a block released behind a sliding window, or row padding) stays -1 on its way to the
kernels, and a kernel asked to read one refuses: it never silently reads block 0, another request's block."""

from __future__ import annotations

import pytest
import torch

from paged_backend import SamplingParams, kernels
from paged_backend.core.block_manager import HOLE
from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.core.sequence import SequenceGroup
from paged_backend.engine.input_builder import prepare_inputs

BLOCK = 4


def _scheduled(num_tokens: int, computed: int) -> ScheduledSeq:
    group = SequenceGroup("r", None, list(range(1, num_tokens + 1)), SamplingParams())
    seq = group.seqs[0]
    seq.num_computed_tokens = computed
    return ScheduledSeq(group, seq, num_tokens - computed)


def _cache(num_blocks: int = 8):
    return torch.zeros(num_blocks, BLOCK, 1, 8), torch.zeros(num_blocks, BLOCK, 1, 8)


def test_holes_and_padding_reach_the_kernels_as_holes():
    a, b = _scheduled(12, 11), _scheduled(4, 3)
    inputs = prepare_inputs([a, b], {a.seq.seq_id: [HOLE, 5, 6], b.seq.seq_id: [2]}, BLOCK)
    assert inputs.block_tables.tolist() == [[-1, 5, 6], [2, -1, -1]]


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_a_kernel_refuses_to_read_a_hole(monkeypatch, backend):
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", backend)
    if backend == "cpp" and not kernels.cpu.available():
        pytest.fail("the C++ kernel should build on this machine")
    seq = _scheduled(12, 11)
    inputs = prepare_inputs([seq], {seq.seq.seq_id: [HOLE, 5, 6]}, BLOCK)
    key_cache, _ = _cache()
    args = (key_cache, inputs.block_tables, inputs.context_lens, inputs.query_start_loc)
    with pytest.raises(ValueError, match="hole"):
        kernels.plan_attention(*args)                      # full attention reads block 0 of the table: a hole
    kernels.plan_attention(*args, sliding_window=4)        # the window starts in the second block: fine


def test_a_new_token_in_a_hole_is_refused():
    seq = _scheduled(12, 11)
    with pytest.raises(ValueError, match="hole"):
        prepare_inputs([seq], {seq.seq.seq_id: [5, 6, HOLE]}, BLOCK)
