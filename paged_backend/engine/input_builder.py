"""Engine side of a step: the scheduler's chunks flattened into the tensors a runner executes."""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch

from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.worker.step_inputs import StepInputs


def prepare_inputs(scheduled: Sequence[ScheduledSeq], block_tables: Dict[int, List[int]],
                   block_size: int) -> StepInputs:
    """Flatten the scheduled chunks (CPU tensors; `StepInputs.to` moves them). Python touches each
    sequence once; positions and cache slots of every token come from tensor ops."""
    tokens: List[int] = []
    first_positions: List[int] = []
    chunk_lens: List[int] = []
    tables: List[List[int]] = []
    sample_rows: List[int] = []
    for item in scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        tokens.extend(seq.token_ids[start:start + item.num_tokens])
        first_positions.append(start)
        chunk_lens.append(item.num_tokens)
        tables.append(block_tables[seq.seq_id])
        if item.samples:
            sample_rows.append(len(tokens) - 1)
    table_tensor = _pad_tables(tables)
    lens = torch.tensor(chunk_lens, dtype=torch.long)
    ends = lens.cumsum(0)
    row_seq = torch.repeat_interleave(torch.arange(len(tables)), lens)            # sequence of each token
    first = torch.tensor(first_positions, dtype=torch.long)
    positions = torch.arange(len(tokens)) - (ends - lens)[row_seq] + first[row_seq]
    slots = table_tensor[row_seq, positions // block_size].to(torch.long) * block_size + positions % block_size
    if bool((slots < 0).any()):
        raise ValueError("a new token's slot lies in a hole of its block table (a released block)")
    return StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        block_tables=table_tensor,
        context_lens=(first + lens).to(torch.int32),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32),
        sample_indices=torch.tensor(sample_rows, dtype=torch.long),
    )


def _pad_tables(tables: List[List[int]]) -> torch.Tensor:
    """The block tables as one int32 `[num_seqs, longest]` tensor, padded with -1 like the holes behind a
    sliding window: the kernels refuse to read either (a numpy row copy per table: no per-block Python)."""
    width = max((len(t) for t in tables), default=0)
    padded = np.full((len(tables), width), -1, dtype=np.int32)
    for row, table in enumerate(tables):
        padded[row, :len(table)] = table
    return torch.from_numpy(padded)
