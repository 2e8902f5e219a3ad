"""Pure-PyTorch reference kernels; also the fast path on the CPU.

Cache layout (per layer): key_cache, value_cache `[num_blocks, block_size, num_kv_heads, head_size]`.
A slot is `block * block_size + offset`. Sequence `s` owns query rows
`query_start_loc[s] : query_start_loc[s + 1]`; they are the last tokens of its `context_lens[s]`
tokens, so query row `i` of a sequence with `q` new tokens sees keys `0 .. context_len - q + i`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_size]` into their cache slots."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    slots = slot_mapping.to(torch.long)
    key_cache.view(num_blocks * block_size, num_kv_heads, head_size).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, num_kv_heads, head_size).index_copy_(
        0, slots, value.to(value_cache.dtype))


def copy_blocks(key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy whole blocks `block_mapping[:, 0] -> block_mapping[:, 1]` in every layer (copy-on-write)."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(device=key_caches[0].device, dtype=torch.long)
    dst = block_mapping[:, 1].to(device=key_caches[0].device, dtype=torch.long)
    for cache in list(key_caches) + list(value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))


@dataclass
class AttentionPlan:
    """Which cache blocks to gather and which keys each query sees, shared by all layers of a step.

    Single-token queries (decode) run as one batch; multi-token queries (prefill chunks) as another,
    each padded to its longest member. K/V are gathered a whole block at a time (block-table rows),
    which moves far fewer index entries than gathering slot by slot.
    """

    decode_rows: torch.Tensor      # [Sd] query rows
    decode_blocks: torch.Tensor    # [Sd, Bd] blocks holding their context (block 0 where padded)
    decode_mask: torch.Tensor      # [Sd, 1, 1, Bd * block_size] True where attended
    prefill_rows: torch.Tensor     # [Sp, Qp] query rows (0 where padded)
    prefill_valid: torch.Tensor    # [Sp, Qp]
    prefill_blocks: torch.Tensor   # [Sp, Bp]
    prefill_mask: torch.Tensor     # [Sp, 1, Qp, Bp * block_size]


def _context_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
    """The block-table columns covering the longest context, and which key positions are real."""
    length = int(context_lens.max()) if context_lens.numel() else 0
    num_blocks = -(-length // block_size)
    blocks = block_tables[:, :num_blocks].to(torch.long)
    pos = torch.arange(num_blocks * block_size, device=block_tables.device)
    valid = pos[None, :] < context_lens[:, None]
    used = torch.arange(num_blocks, device=block_tables.device)[None, :] * block_size < context_lens[:, None]
    return torch.where(used, blocks, torch.zeros_like(blocks)), valid


def plan_paged_attention(block_tables: torch.Tensor, context_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, block_size: int) -> AttentionPlan:
    """Build the gather plan once per step (it depends only on the step's metadata)."""
    context_lens = context_lens.to(torch.long)
    starts = query_start_loc.to(torch.long)
    q_lens = starts[1:] - starts[:-1]
    is_decode = q_lens == 1
    d_blocks, d_valid = _context_blocks(block_tables[is_decode], context_lens[is_decode], block_size)
    p_idx = (~is_decode).nonzero().flatten()
    p_q = q_lens[p_idx]
    p_ctx = context_lens[p_idx]
    q_pad = int(p_q.max()) if p_idx.numel() else 0
    qi = torch.arange(q_pad, device=starts.device)
    p_valid = qi[None, :] < p_q[:, None]
    p_rows = torch.where(p_valid, starts[p_idx][:, None] + qi[None, :], torch.zeros_like(qi)[None, :])
    p_blocks, p_kvalid = _context_blocks(block_tables[p_idx], p_ctx, block_size)
    kj = torch.arange(p_kvalid.shape[1], device=starts.device)
    last_visible = (p_ctx - p_q)[:, None] + qi[None, :]                       # [Sp, Qp]
    p_mask = p_kvalid[:, None, :] & (kj[None, None, :] <= last_visible[:, :, None])
    if p_mask.numel():
        p_mask[:, :, 0] |= ~p_valid  # padded query rows see one key so softmax stays finite
    return AttentionPlan(
        decode_rows=starts[:-1][is_decode], decode_blocks=d_blocks, decode_mask=d_valid[:, None, None, :],
        prefill_rows=p_rows, prefill_valid=p_valid, prefill_blocks=p_blocks, prefill_mask=p_mask[:, None])


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`[S, num_kv_heads, B * block_size, head_size]` keys or values of the given blocks."""
    _, block_size, num_kv_heads, head_size = cache.shape
    return cache[blocks].view(blocks.shape[0], -1, num_kv_heads, head_size).transpose(1, 2)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, out: Optional[torch.Tensor] = None,
                    plan: Optional[AttentionPlan] = None) -> torch.Tensor:
    """Attention of `query` `[num_tokens, num_heads, head_size]` over each sequence's paged context.

    Cache slots of a gathered block that hold no token of the sequence are masked out, but they are
    still multiplied by zero weights, so they must hold finite numbers (the engine zero-fills the cache).
    """
    if plan is None:
        plan = plan_paged_attention(block_tables, context_lens, query_start_loc, key_cache.shape[1])
    if out is None:
        out = torch.empty_like(query)
    gqa = query.shape[1] != key_cache.shape[2]
    if plan.decode_rows.numel():
        q = query[plan.decode_rows].unsqueeze(2)                                # [Sd, H, 1, D]
        k, v = _gather(key_cache, plan.decode_blocks), _gather(value_cache, plan.decode_blocks)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=gqa)
        out[plan.decode_rows] = o.squeeze(2).to(out.dtype)
    if plan.prefill_rows.numel():
        q = query[plan.prefill_rows].transpose(1, 2)                            # [Sp, H, Qp, D]
        k, v = _gather(key_cache, plan.prefill_blocks), _gather(value_cache, plan.prefill_blocks)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.prefill_mask, scale=scale, enable_gqa=gqa)
        o = o.transpose(1, 2)                                                   # [Sp, Qp, H, D]
        out[plan.prefill_rows[plan.prefill_valid]] = o[plan.prefill_valid].to(out.dtype)
    return out


def dense_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The obvious loop over sequences and heads, for testing the kernels (slow)."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for s in range(len(context_lens)):
        start, end, length = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        pos = torch.arange(length)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = key_cache.reshape(-1, num_kv_heads, head_size)[slots].repeat_interleave(group, dim=1)
        v = value_cache.reshape(-1, num_kv_heads, head_size)[slots].repeat_interleave(group, dim=1)
        q = query[start:end]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = pos[None, :] <= (length - (end - start) + torch.arange(end - start))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
