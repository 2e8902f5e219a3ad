"""Engine side of a step: the scheduler's chunks flattened into the tensors a runner executes.

With overlapped scheduling a decode row's input token may still be being sampled by the step before: its input
id is left as a placeholder and `TokenFill` says where it comes from (a row of that step's sampled tokens), so
the worker fills every such id with one indexed copy just before the forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.worker.step_inputs import DeviceFill, StepInputs


@dataclass
class TokenFill:
    """Input ids that are the previous step's sampled tokens: `input_ids[positions] = tokens[rows]`."""

    positions: torch.Tensor   # [P] int64 indices into the step's input ids
    rows: torch.Tensor        # [P] int64 rows of the previous step's sampled tokens

    def apply(self, input_ids: torch.Tensor, tokens: Optional[torch.Tensor]) -> None:
        """Fill the placeholders (with token 0 when the previous step produced no tokens: it failed, and so did
        the requests whose rows these are)."""
        if tokens is None:
            input_ids[self.positions] = 0
        else:
            DeviceFill(self.positions, self.rows, tokens).apply(input_ids)


def prepare_inputs(scheduled: Sequence[ScheduledSeq], block_tables: Dict[int, List[int]],
                   block_size: int) -> StepInputs:
    """Flatten the scheduled chunks (CPU tensors; `StepInputs.to` moves them), every token known."""
    inputs, fill = prepare_step(scheduled, block_tables, block_size)
    if fill is not None:
        raise ValueError("a scheduled token is still being sampled; use prepare_step with the previous step's rows")
    return inputs


def prepare_step(scheduled: Sequence[ScheduledSeq], block_tables: Dict[int, List[int]], block_size: int,
                 pending_rows: Optional[Dict[int, int]] = None) -> Tuple[StepInputs, Optional[TokenFill]]:
    """The step's inputs and, when some of its tokens are still being sampled, where they come from
    (`pending_rows`: sequence id -> its row among the previous step's sampled tokens). Python touches each
    sequence once; positions and cache slots of every token come from tensor ops. A speculating sequence's chunk
    is its last token and its draft tokens, and every one of them samples: their logits rows come after all the
    other sampled rows, in the order of the chunks."""
    tokens: List[int] = []
    first_positions: List[int] = []
    chunk_lens: List[int] = []
    tables: List[List[int]] = []
    sample_rows: List[int] = []
    fill_positions: List[int] = []
    fill_rows: List[int] = []
    draft_rows: List[int] = []
    for item in scheduled:
        seq = item.seq
        start, n = item.start, item.num_tokens
        ids = seq.token_ids
        if n == 1 and start < len(ids):
            tokens.append(ids[start])
        elif seq.draft_token_ids and item.samples:  # speculative decoding: its last token, then its drafts
            tokens.extend(ids[start:])
            tokens.extend(seq.draft_token_ids)
            draft_rows.extend(range(len(tokens) - n, len(tokens)))
        else:
            chunk = ids[start:start + n]
            tokens.extend(chunk)
            if len(chunk) < n:  # the chunk's last token is still being sampled by the previous step
                if len(chunk) != n - 1 or pending_rows is None or seq.seq_id not in pending_rows:
                    raise ValueError(f"sequence {seq.seq_id}: {n - len(chunk)} of its scheduled tokens are unknown")
                fill_positions.append(len(tokens))
                fill_rows.append(pending_rows[seq.seq_id])
                tokens.append(0)
        first_positions.append(start)
        chunk_lens.append(n)
        tables.append(block_tables[seq.seq_id])
        if item.samples and not seq.draft_token_ids:
            sample_rows.append(len(tokens) - 1)
    n = len(chunk_lens)
    table_array = _pad_tables(tables)
    lens = np.array(chunk_lens, dtype=np.int64)
    first = np.array(first_positions, dtype=np.int64)
    ends = np.cumsum(lens)
    if len(tokens) == n:  # a decode step: one token per sequence
        row_seq = np.arange(n)
        positions = first.copy()
    else:
        row_seq = np.repeat(np.arange(n), lens)                                      # sequence of each token
        positions = np.arange(len(tokens)) - (ends - lens)[row_seq] + first[row_seq]
    slots = table_array[row_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    if n and bool((slots < 0).any()):
        raise ValueError("a new token's slot lies in a hole of its block table (a released block)")
    query_start = np.zeros(n + 1, dtype=np.int32)
    query_start[1:] = ends
    inputs = StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(table_array),
        context_lens=torch.from_numpy((first + lens).astype(np.int32)),
        query_start_loc=torch.from_numpy(query_start),
        sample_indices=torch.tensor(sample_rows + draft_rows if draft_rows else sample_rows, dtype=torch.long),
    )
    fill = TokenFill(torch.tensor(fill_positions, dtype=torch.long), torch.tensor(fill_rows, dtype=torch.long)) \
        if fill_positions else None
    return inputs, fill


def _pad_tables(tables: List[List[int]]) -> np.ndarray:
    """The block tables as one int32 `[num_seqs, longest]` array, padded with -1 like the holes behind a
    sliding window: the kernels refuse to read either (one conversion of all their entries, then one masked
    store: no per-table or per-block Python)."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max()) if len(tables) else 0
    padded = np.full((len(tables), width), -1, dtype=np.int32)
    if width:
        padded[np.arange(width)[None, :] < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    return padded
