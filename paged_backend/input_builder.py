"""Engine side of a step: the scheduler's chunks flattened into the tensors a runner executes."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .scheduler import ScheduledSeq
from .step_inputs import StepInputs


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
    width = max((len(t) for t in tables), default=0)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    table_tensor = table_tensor.reshape(len(tables), width).clamp_(min=0)  # holes (-1): any valid block
    lens = torch.tensor(chunk_lens, dtype=torch.long)
    ends = lens.cumsum(0)
    row_seq = torch.repeat_interleave(torch.arange(len(tables)), lens)            # sequence of each token
    first = torch.tensor(first_positions, dtype=torch.long)
    positions = torch.arange(len(tokens)) - (ends - lens)[row_seq] + first[row_seq]
    slots = table_tensor[row_seq, positions // block_size].to(torch.long) * block_size + positions % block_size
    return StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        block_tables=table_tensor,
        context_lens=(first + lens).to(torch.int32),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32),
        sample_indices=torch.tensor(sample_rows, dtype=torch.long),
    )
