"""Random paged-attention inputs for the kernel tests: shuffled block tables, ragged lengths, NaN guards."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

# A fresh seed per test run (set PAGED_BACKEND_TEST_SEED to replay one); failures print it.
BASE_SEED = int(os.environ.get("PAGED_BACKEND_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))


def case_seed(*parts) -> int:
    """A seed for one test case: the run's base seed mixed with the case's parameters."""
    return (BASE_SEED * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(repr(parts)))) % (2 ** 63)


@dataclass
class PagedInputs:
    """One batch: query rows of each sequence are the last `query_lens[s]` of its `context_lens[s]` tokens."""

    query: torch.Tensor            # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_size]; NaN outside contexts
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32, padded with 0
    context_lens: torch.Tensor     # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float
    holes: torch.Tensor            # [num_seqs, max_blocks] table entries wholly before every query's window
    spare_block: int               # a block that is NaN everywhere

    def args(self, clean_cache: bool = False, hole: Optional[int] = None):
        """Positional args of `paged_attention`; `clean_cache` zeroes the NaN guards (for the reference,
        whose padded gathers read slot 0); `hole` replaces the table entries before the window."""
        kc, vc = self.key_cache, self.value_cache
        if clean_cache:
            kc, vc = torch.nan_to_num(kc, nan=0.0), torch.nan_to_num(vc, nan=0.0)
        tables = self.block_tables
        if hole is not None:
            tables = torch.where(self.holes, torch.full_like(tables, hole), tables)
        return (self.query, kc, vc, tables, self.context_lens, self.query_start_loc, self.scale)


def make_paged_inputs(seed: int, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int,
                      block_size: int, context_lens: Sequence[int], query_lens: Sequence[int],
                      spare_blocks: int = 3, extra_table_columns: int = 1,
                      sliding_window: Optional[int] = None) -> PagedInputs:
    """Physical blocks are a random permutation (non-contiguous per sequence); every slot that holds
    no context token is NaN, so a kernel that reads an unmasked slot produces NaN. With a sliding
    window, keys before the window of a sequence's first query are NaN too, and `holes` marks the table
    entries of blocks wholly before it (the engine may free those blocks)."""
    if spare_blocks < 1:
        raise ValueError("at least one spare block is needed (a NaN block for holes)")
    if any(q < 1 or q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError("each query length must be in 1..context length")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    physical: List[int] = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + extra_table_columns
    block_tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    next_block = 0
    for s, (length, count) in enumerate(zip(context_lens, blocks_per_seq)):
        table = physical[next_block:next_block + count]
        next_block += count
        block_tables[s, :count] = torch.tensor(table, dtype=torch.int32)
        for pos in range(length):
            b, off = table[pos // block_size], pos % block_size
            key_cache[b, off] = torch.randn(num_kv_heads, head_size, generator=gen).to(dtype)
            value_cache[b, off] = torch.randn(num_kv_heads, head_size, generator=gen).to(dtype)
    holes = torch.zeros_like(block_tables, dtype=torch.bool)
    if sliding_window is not None:
        for s, (length, q_len) in enumerate(zip(context_lens, query_lens)):
            first_key = max(0, length - q_len - sliding_window + 1)
            for pos in range(first_key):
                b, off = int(block_tables[s, pos // block_size]), pos % block_size
                key_cache[b, off] = float("nan")
                value_cache[b, off] = float("nan")
            holes[s, :first_key // block_size] = True
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_size, generator=gen).to(dtype)
    return PagedInputs(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                       context_lens=torch.tensor(list(context_lens), dtype=torch.int32),
                       query_start_loc=torch.tensor(starts, dtype=torch.int32), scale=head_size ** -0.5,
                       holes=holes, spare_block=physical[-1])


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, so that rows a kernel forgets to write fail the comparison."""
    return torch.full_like(tensor, float("nan"))


def variant_kwargs(variant: str, seed: int, num_heads: int, dtype: torch.dtype, sliding_window: Optional[int] = None):
    """Keyword arguments of one attention variant: "plain", "window", "softcap", "sinks" or "all"."""
    gen = torch.Generator().manual_seed(seed)
    kwargs = {}
    if variant in ("window", "all"):
        kwargs["sliding_window"] = sliding_window
    if variant in ("softcap", "all"):
        kwargs["softcap"] = 1.5
    if variant in ("sinks", "all"):
        kwargs["sinks"] = (2 * torch.randn(num_heads, generator=gen)).to(dtype)
    return kwargs
