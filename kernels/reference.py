"""Pure-PyTorch reference kernels; also the fast path on the CPU.

Cache layout (per layer): key_cache, value_cache `[num_blocks, block_size, num_kv_heads, head_size]`.
A slot is `block * block_size + offset`. Sequence `s` owns query rows
`query_start_loc[s] : query_start_loc[s + 1]`; they are the last tokens of its `context_lens[s]`
tokens, so query row `i` of a sequence with `q` new tokens sees keys `0 .. context_len - q + i` (only
the last `sliding_window` of them when a window is given; see variant.py for the variants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from .kv_quant import check_scales, dequantize, quantize, raw_bits
from .variant import check_attention_variant


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_size]` into their cache slots (as kv_quant.quantize
    stores them: `value / scale` in the cache's dtype)."""
    check_scales(k_scale, v_scale)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    slots = slot_mapping.to(torch.long)
    if bool((slots < 0).any()):   # padding rows (worker/cuda_graphs.py) write nothing, as in the Triton kernel
        kept = (slots >= 0).nonzero().flatten()
        slots, key, value = slots[kept], key[kept], value[kept]
    for cache, values, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        entries = quantize(values, cache.dtype, scale)
        raw_bits(cache).view(num_blocks * block_size, num_kv_heads, head_size).index_copy_(0, slots, raw_bits(entries))


def copy_blocks(key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy whole blocks `block_mapping[:, 0] -> block_mapping[:, 1]` in every layer (copy-on-write)."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(device=key_caches[0].device, dtype=torch.long)
    dst = block_mapping[:, 1].to(device=key_caches[0].device, dtype=torch.long)
    for cache in list(key_caches) + list(value_caches):
        bits = raw_bits(cache)
        bits.index_copy_(0, dst, bits.index_select(0, src))


@dataclass
class AttentionPlan:
    """Which cache blocks to gather and which keys each query sees, shared by the layers of a step that
    use the same sliding window.

    Single-token queries (decode) run as one batch; multi-token queries (prefill chunks) as another,
    each padded to its longest member. K/V are gathered a whole block at a time (block-table rows),
    which moves far fewer index entries than gathering slot by slot. With a sliding window only the
    blocks that hold a visible key are gathered (block-table columns before them are never read).
    """

    decode_rows: torch.Tensor      # [Sd] query rows
    decode_blocks: torch.Tensor    # [Sd, Bd] blocks holding their visible context (block 0 where padded)
    decode_mask: torch.Tensor      # [Sd, 1, 1, Bd * block_size] True where attended
    prefill_rows: torch.Tensor     # [Sp, Qp] query rows (0 where padded)
    prefill_valid: torch.Tensor    # [Sp, Qp]
    prefill_blocks: torch.Tensor   # [Sp, Bp]
    prefill_mask: torch.Tensor     # [Sp, 1, Qp, Bp * block_size]
    sliding_window: Optional[int] = None


def check_block_reads(block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      block_size: int, num_blocks: int, sliding_window: Optional[int] = None) -> None:
    """ValueError unless every block-table entry that attention reads (the blocks of each sequence's visible keys:
    from the window of its first new token to its last key) is a block of the cache. Holes behind a sliding
    window and row padding are -1: reading one would read another request's block, so it is an error."""
    if not context_lens.numel():
        return
    lens = context_lens.to(torch.long)
    starts = query_start_loc.to(torch.long)
    q_lens = starts[1:] - starts[:-1]
    if bool((lens < q_lens).any()) or bool((lens > block_tables.shape[1] * block_size).any()):
        raise ValueError("each context length must cover its new tokens and fit in its block-table row")
    first = _first_keys((lens - q_lens).clamp(min=0), sliding_window)
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    read = (columns[None, :] >= (first // block_size)[:, None]) & (columns[None, :] * block_size < lens[:, None])
    read &= (q_lens > 0)[:, None]
    if bool((read & ((block_tables < 0) | (block_tables >= num_blocks))).any()):
        raise ValueError(f"a block-table entry the attention reads is a hole or outside the cache of {num_blocks} "
                         "blocks")


def _context_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor, first_keys: torch.Tensor,
                    block_size: int):
    """The blocks holding keys `first_keys[s] .. context_lens[s] - 1` of each sequence (a window of
    block-table columns starting at the block of its first key), those keys' positions, and which
    gathered positions are real keys of that range."""
    first_blocks = first_keys // block_size
    counts = -(-context_lens // block_size) - first_blocks
    width = int(counts.max()) if counts.numel() else 0
    offsets = torch.arange(width, device=block_tables.device)
    columns = first_blocks[:, None] + offsets[None, :]
    used = offsets[None, :] < counts[:, None]
    blocks = block_tables.to(torch.long).gather(1, torch.where(used, columns, torch.zeros_like(columns)))
    positions = first_blocks[:, None] * block_size + torch.arange(width * block_size, device=block_tables.device)
    valid = (positions < context_lens[:, None]) & (positions >= first_keys[:, None])
    return torch.where(used, blocks, torch.zeros_like(blocks)), positions, valid


def _first_keys(first_query_pos: torch.Tensor, sliding_window: Optional[int]) -> torch.Tensor:
    """The lowest key position any query of a sequence sees (0 without a window)."""
    if sliding_window is None:
        return torch.zeros_like(first_query_pos)
    return (first_query_pos - sliding_window + 1).clamp(min=0)


def plan_paged_attention(block_tables: torch.Tensor, context_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, block_size: int,
                         sliding_window: Optional[int] = None) -> AttentionPlan:
    """Build the gather plan once per step and window (it depends only on the step's metadata)."""
    context_lens = context_lens.to(torch.long)
    starts = query_start_loc.to(torch.long)
    q_lens = starts[1:] - starts[:-1]
    is_decode = q_lens == 1
    d_ctx = context_lens[is_decode]
    d_blocks, _, d_valid = _context_blocks(block_tables[is_decode], d_ctx, _first_keys(d_ctx - 1, sliding_window),
                                           block_size)
    p_idx = (~is_decode).nonzero().flatten()
    p_q = q_lens[p_idx]
    p_ctx = context_lens[p_idx]
    q_pad = int(p_q.max()) if p_idx.numel() else 0
    qi = torch.arange(q_pad, device=starts.device)
    p_valid = qi[None, :] < p_q[:, None]
    p_rows = torch.where(p_valid, starts[p_idx][:, None] + qi[None, :], torch.zeros_like(qi)[None, :])
    p_first_pos = p_ctx - p_q
    p_blocks, p_pos, p_kvalid = _context_blocks(block_tables[p_idx], p_ctx, _first_keys(p_first_pos, sliding_window),
                                                block_size)
    q_pos = p_first_pos[:, None] + qi[None, :]                                 # [Sp, Qp]
    p_mask = p_kvalid[:, None, :] & (p_pos[:, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        p_mask &= p_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    if p_mask.numel():
        p_mask[:, :, 0] |= ~p_valid  # padded query rows see one key so softmax stays finite
    return AttentionPlan(
        decode_rows=starts[:-1][is_decode], decode_blocks=d_blocks, decode_mask=d_valid[:, None, None, :],
        prefill_rows=p_rows, prefill_valid=p_valid, prefill_blocks=p_blocks, prefill_mask=p_mask[:, None],
        sliding_window=sliding_window)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`[S, num_kv_heads, B * block_size, head_size]` keys or values of the given blocks as `dtype` values
    (`index_select` copies whole blocks; advanced indexing `cache[blocks]` was 1.5-3x slower on the CPU)."""
    _, block_size, num_kv_heads, head_size = cache.shape
    gathered = raw_bits(cache).index_select(0, blocks.reshape(-1)).view(cache.dtype)
    gathered = dequantize(gathered, dtype, scale)
    return gathered.view(blocks.shape[0], -1, num_kv_heads, head_size).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Masked attention `[S, H, Q, D]` x `[S, KVH, K, D]` -> `[S, H, Q, D]`; SDPA unless the scores need a
    soft-cap or sinks, which SDPA cannot apply (then explicit scores, in at least fp32)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    compute = torch.promote_types(q.dtype, torch.float32)
    s, h, nq, d = q.shape
    kv_heads = k.shape[1]
    qg = q.to(compute).view(s, kv_heads, h // kv_heads, nq, d)                      # [S, KVH, G, Q, D]
    scores = torch.einsum("sngqd,snkd->sngqk", qg, k.to(compute)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(compute).view(1, kv_heads, h // kv_heads, 1, 1).expand(s, -1, -1, nq, 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = torch.einsum("sngqk,snkd->sngqd", probs, v.to(compute))
    return out.reshape(s, h, nq, d).to(q.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, out: Optional[torch.Tensor] = None,
                    plan: Optional[AttentionPlan] = None, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of `query` `[num_tokens, num_heads, head_size]` over each sequence's paged context,
    optionally windowed, soft-capped and with sinks (see variant.py). The cache may hold another dtype
    than the query (fp8 entries times k_scale / v_scale): gathered blocks are converted to the query's.

    Cache slots of a gathered block that hold no visible key are masked out, but they are still
    multiplied by zero weights, so they must hold finite numbers (the engine zero-fills the cache).
    """
    check_attention_variant(query.shape[1], query.device, sliding_window, softcap, sinks)
    check_scales(k_scale, v_scale)
    if plan is None:
        plan = plan_paged_attention(block_tables, context_lens, query_start_loc, key_cache.shape[1], sliding_window)
    elif plan.sliding_window != sliding_window:
        raise ValueError(f"the plan was built for sliding_window={plan.sliding_window}, "
                         f"this call has sliding_window={sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    if plan.decode_rows.numel():
        q = query[plan.decode_rows].unsqueeze(2)                                # [Sd, H, 1, D]
        k = _gather(key_cache, plan.decode_blocks, query.dtype, k_scale)
        v = _gather(value_cache, plan.decode_blocks, query.dtype, v_scale)
        o = _attend(q, k, v, plan.decode_mask, scale, softcap, sinks)
        out[plan.decode_rows] = o.squeeze(2).to(out.dtype)
    if plan.prefill_rows.numel():
        q = query[plan.prefill_rows].transpose(1, 2)                            # [Sp, H, Qp, D]
        k = _gather(key_cache, plan.prefill_blocks, query.dtype, k_scale)
        v = _gather(value_cache, plan.prefill_blocks, query.dtype, v_scale)
        o = _attend(q, k, v, plan.prefill_mask, scale, softcap, sinks)
        o = o.transpose(1, 2)                                                   # [Sp, Qp, H, D]
        out[plan.prefill_rows[plan.prefill_valid]] = o[plan.prefill_valid].to(out.dtype)
    return out


def dense_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The obvious loop over sequences and heads, for testing the kernels (slow). Reads only the slots
    of visible keys; cache entries are converted to the query's dtype (times the scales)."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for s in range(len(context_lens)):
        start, end, length = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        q_pos = length - (end - start) + torch.arange(end - start)
        first = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
        pos = torch.arange(first, length)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = dequantize(raw_bits(key_cache).reshape(-1, num_kv_heads, head_size)[slots].view(key_cache.dtype),
                       query.dtype, k_scale).repeat_interleave(group, dim=1)
        v = dequantize(raw_bits(value_cache).reshape(-1, num_kv_heads, head_size)[slots].view(value_cache.dtype),
                       query.dtype, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end], k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(-1, end - start, 1)], dim=-1)
        weights = scores.softmax(-1)[..., :len(pos)]
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, v)
    return out
