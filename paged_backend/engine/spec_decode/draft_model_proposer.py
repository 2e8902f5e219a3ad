"""A draft model's proposals ("draft_model"): a smaller model with the target's tokenizer guesses k tokens over
its own paged KV cache.

The draft keeps, per target sequence, a block table in its own block pool and the tokens whose K/V its cache
holds. Before proposing it rolls that back to the longest prefix the sequence still has (drafts the target
rejected are forgotten, their blocks freed), computes the sequence's tokens after it in one batched forward
(the whole prompt the first time, else the tokens accepted since), then decodes k - 1 further tokens one batched
forward each: greedily (a point mass), or for a sampled request drawn from softmax(logits / temperature), whose
rows it keeps as q for the speculative-sampling rule (rejection.py).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import numpy as np
import torch

from paged_backend.core.block_allocator import BlockAllocator
from paged_backend.core.sequence import Sequence
from paged_backend.worker.cache_engine import CacheEngine, kv_geometry
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.step_inputs import StepInputs

Chunk = Tuple[List[int], int, List[int]]   # tokens to compute, the position of the first, the block table


def draft_inputs(chunks: Seq[Chunk], block_size: int) -> StepInputs:
    """One forward over several sequences' chunks, sampling each chunk's last position."""
    tokens = list(itertools.chain.from_iterable(c[0] for c in chunks))
    lens = np.array([len(c[0]) for c in chunks], dtype=np.int64)
    first = np.array([c[1] for c in chunks], dtype=np.int64)
    ends = np.cumsum(lens)
    row = np.repeat(np.arange(len(chunks)), lens)
    positions = np.arange(len(tokens)) - (ends - lens)[row] + first[row]
    width = max(len(c[2]) for c in chunks)
    tables = np.full((len(chunks), width), -1, dtype=np.int32)
    for i, (_, _, table) in enumerate(chunks):
        tables[i, :len(table)] = table
    slots = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    query_start = np.zeros(len(chunks) + 1, dtype=np.int32)
    query_start[1:] = ends
    return StepInputs(input_ids=torch.tensor(tokens, dtype=torch.long), positions=torch.from_numpy(positions),
                      slot_mapping=torch.from_numpy(slots), block_tables=torch.from_numpy(tables),
                      context_lens=torch.from_numpy((first + lens).astype(np.int32)),
                      query_start_loc=torch.from_numpy(query_start),
                      sample_indices=torch.from_numpy(ends - 1))


def common_prefix(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


class DraftModelProposer:
    """Greedy proposals of a draft model over its own paged cache (`num_blocks` blocks of `block_size`)."""

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int, seed: int = 0) -> None:
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        cache = CacheEngine(kv_geometry(model.config), block_size, num_blocks, 0, dtype, device)
        self.runner = ModelRunner(model, cache)
        self.block_size = block_size
        self.pool = BlockAllocator(num_blocks, "draft")
        self.tables: Dict[int, List[int]] = {}
        self.cached: Dict[int, List[int]] = {}   # seq_id -> the tokens whose K/V the draft cache holds
        self.probs: Dict[int, torch.Tensor] = {}   # seq_id -> q of its last drawn guesses ([k, V])
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int], temperatures: Seq[float] = ()) -> List[List[int]]:
        proposals: List[List[int]] = [[] for _ in seqs]
        self.probs = {}
        temps = list(temperatures) or [0.0] * len(seqs)
        live = [(i, seq, k) for i, (seq, k) in enumerate(zip(seqs, max_tokens)) if k > 0 and self._prepare(seq, k)]
        if not live:
            return proposals
        chunks = []
        for _, seq, _ in live:
            done = len(self.cached[seq.seq_id])
            chunks.append((seq.token_ids[done:], done, self.tables[seq.seq_id]))
            self.cached[seq.seq_id] = list(seq.token_ids)
        rows = [(i, seq) for i, seq, _ in live]
        for step in range(max(k for _, _, k in live)):
            if step:
                rows = [(i, seq) for i, seq, k in live if k > step]
                chunks = []
                for i, seq in rows:
                    cached = self.cached[seq.seq_id]
                    chunks.append(([proposals[i][-1]], len(cached), self.tables[seq.seq_id]))
                    cached.append(proposals[i][-1])
            logits = self.runner.execute(draft_inputs(chunks, self.block_size))
            for (i, seq), row in zip(rows, logits):
                proposals[i].append(self._draw(seq.seq_id, row, temps[i]))
        self.probs = {sid: torch.stack(rows) for sid, rows in self.probs.items()}
        return proposals

    def _draw(self, seq_id: int, logits: torch.Tensor, temperature: float) -> int:
        """Greedy (a point mass), or one draw from softmax(logits / temperature), whose row is kept as q."""
        if temperature <= 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        self.probs.setdefault(seq_id, []).append(probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))   # the generator is the host's

    def draft_probs(self, seq_id: int) -> Optional[torch.Tensor]:
        return self.probs.get(seq_id)

    def _prepare(self, seq: Sequence, k: int) -> bool:
        """Roll the draft's cache of the sequence back to the prefix it still has (at least its last token is
        computed again, for the logits) and give it slots for its tokens and k - 1 drafts; False (and nothing
        kept) when the draft pool is out of blocks."""
        sid = seq.seq_id
        cached = self.cached.setdefault(sid, [])
        table = self.tables.setdefault(sid, [])
        keep = min(common_prefix(cached, seq.token_ids), len(seq.token_ids) - 1)
        del cached[keep:]
        self._trim(table, -(-keep // self.block_size))
        needed = -(-(len(seq.token_ids) + k - 1) // self.block_size)
        if needed - len(table) > self.pool.get_num_free_blocks():
            self.release([sid])
            return False
        while len(table) < needed:
            table.append(self.pool.allocate())
        return True

    def _trim(self, table: List[int], length: int) -> None:
        while len(table) > length:
            self.pool.free(table.pop())

    def release(self, seq_ids: Seq[int]) -> None:
        for sid in seq_ids:
            self._trim(self.tables.pop(sid, []), 0)
            self.cached.pop(sid, None)

    def shutdown(self) -> None:
        """Free the draft's KV cache."""
        self.release(list(self.tables))
        self.runner.shutdown()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def tracked(self) -> List[int]:
        """The sequences whose K/V the draft cache holds."""
        return list(self.tables)
