"""PagedAttention in Triton: one kernel for decode and prefill over a paged context, plus split-KV.

A program owns a *query tile* (up to BLOCK_Q consecutive new tokens of one sequence, times the GROUP
query heads that share one KV head, flattened into BLOCK_M rows) and walks that sequence's context
in TILE_N-token tiles, reading each token's K/V through the block table, with an fp32 online
softmax. Grid: (query tiles, KV heads, KV splits). With splits > 1 each program covers one segment
of the context and writes an unnormalised partial result; `combine_splits_kernel` merges them.
Variants (see variant.py): a sliding window (the walk starts at the tile's first visible key and a
mask drops keys that left a row's window), logit soft-capping (`cap * tanh(s / cap)` on the scores)
and sinks (one logit per head added to the softmax denominator after the walk, or in the merge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_fp8 import cache_operand, decode_fp8, kv_format
from .triton_launch import Launch, is_interpreted, next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """tanh from exp2 (libdevice's tanh does not run under the interpreter); exact to fp32 rounding."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))          # exp(-2|x|), in (0, 1]: never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr,
    scale_log2e, cap_scale, cap_log2e, window, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """Attention of one query tile x one KV head (x one context segment when NUM_SPLITS > 1).

    Scores in log2 units: `dot * scale * log2(e)`, or with SOFTCAP `cap * log2(e) * tanh(dot * scale / cap)`
    (`cap_log2e`, `cap_scale`). With HAS_WINDOW the row at position p sees keys p - window < j <= p; the
    walk starts at the first row's first visible key, so table entries before it are never read. K/V tiles
    are converted to the query's dtype as they are loaded (fp8 caches arrive as bytes, KV_FORMAT 1 / 2);
    k_scale is folded into the score scales (v_scale multiplies the output after the launch)."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence s owns tiles [query_start_loc[s] // BLOCK_Q + s, ...): at least cdiv(q_len, BLOCK_Q) of
    # them, and all sequences fit in num_tokens // BLOCK_Q + num_seqs tiles. Binary search for s.
    lo = tile_id * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile_id, mid, lo)
        hi = tl.where(first_tile <= tile_id, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile_id - (q_start // BLOCK_Q + seq)
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = context_len - q_len  # context position of the sequence's first new token

    # Rows: query token (row // GROUP) of the tile x query head (row % GROUP) of this KV head.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_local = local_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (q_local < q_len)
    d_valid = offs_d < HEAD_SIZE
    token = (q_start + q_local).to(tl.int64)
    q_pos = first_pos + q_local
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys this tile can see: kv_start .. last row's position; empty for tiles past the sequence's end.
    tile_rows = tl.minimum((local_tile + 1) * BLOCK_Q, q_len)
    kv_end = tl.where(local_tile * BLOCK_Q < q_len, first_pos + tile_rows, 0)
    if HAS_WINDOW:
        kv_start = tl.minimum(tl.maximum(first_pos + local_tile * BLOCK_Q - window + 1, 0), kv_end)
    else:
        kv_start = kv_end * 0
    if NUM_SPLITS == 1:
        kv_lo = kv_start
        kv_hi = kv_end
    else:
        segment = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        kv_lo = kv_start + split * segment
        kv_hi = tl.minimum(kv_lo + segment, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n0 = tl.arange(0, TILE_N)
    for start in range(kv_lo, kv_hi, TILE_N):
        offs_n = start + offs_n0
        key_valid = offs_n < kv_hi
        blocks = tl.load(table_row + offs_n // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_ptrs = (key_cache_ptr + blocks[None, :] * stride_kb + in_block[None, :] * stride_kt
                  + kv_head * stride_kh + offs_d[:, None])                             # [HEAD_PAD, TILE_N]
        v_ptrs = (value_cache_ptr + blocks[:, None] * stride_vb + in_block[:, None] * stride_vt
                  + kv_head * stride_vh + offs_d[None, :])                             # [TILE_N, HEAD_PAD]
        if KV_FORMAT == 0:
            k = tl.load(k_ptrs, mask=d_valid[:, None] & key_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        else:   # fp8 bytes
            k = decode_fp8(tl.load(k_ptrs, mask=d_valid[:, None] & key_valid[None, :], other=0), KV_FORMAT)
            v = decode_fp8(tl.load(v_ptrs, mask=key_valid[:, None] & d_valid[None, :], other=0), KV_FORMAT)
        k = k.to(query_ptr.dtype.element_ty)   # no-ops when the cache holds the query's dtype
        v = v.to(query_ptr.dtype.element_ty)
        if DOT_FP32:
            k = k.to(tl.float32)
        if SOFTCAP:
            scores = _tanh(tl.dot(q, k, input_precision=PRECISION) * cap_scale) * cap_log2e
        else:
            scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2e
        visible = row_valid[:, None] & key_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at 0
        p = tl.exp2(scores - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:   # the sink joins the denominator: rescale to max(m, sink) and add exp2(sink - max)
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_all)
            l_i = l_i * alpha + tl.exp2(sink - m_all)
            acc = acc * alpha[:, None]
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (token * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def combine_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, stride_ot, stride_oh,
                          HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          HAS_SINKS: tl.constexpr):
    """Program (token, head): merge the NUM_SPLITS partial softmax results (and the head's sink) into
    the output row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = (token * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_max_ptr + first + offs_s)
    l_parts = tl.load(part_sum_ptr + first + offs_s)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))   # empty segments weigh 0
    total = tl.sum(weight * l_parts, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_all)
    acc = tl.load(part_acc_ptr + (first + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    o = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape of one `paged_attention` launch (all powers of two)."""

    block_m: int       # rows per program: block_q query tokens x group heads (padded)
    block_q: int       # query tokens per program
    tile_n: int        # context tokens per inner-loop step
    head_pad: int      # head_size rounded up to a power of two (>= 16)
    num_splits: int    # context segments per query tile (1: no split-KV)
    num_warps: int
    num_stages: int


_MAX_SPLITS = 32
_MIN_SEGMENT = 256   # context tokens per split at least, so a split is worth its partial write


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0


def auto_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, context_bound: int,
                    sm_count: int) -> int:
    """Split-KV only for decode batches whose (sequence, KV head) programs leave most SMs idle."""
    if num_tokens != num_seqs or sm_count <= 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= sm_count or context_bound < 2 * _MIN_SEGMENT:
        return 1
    wanted = min(_MAX_SPLITS, -(-2 * sm_count // programs), context_bound // _MIN_SEGMENT)
    splits = 1
    while splits * 2 <= wanted:
        splits *= 2
    return splits


def attention_config(num_tokens: int, num_seqs: int, group: int, head_size: int, num_splits: int = 1,
                     element_size: int = 2, fp8_cache: bool = False) -> AttentionConfig:
    """Tiles per phase and dtype, chosen so that no variant spills registers on sm_80/sm_90.

    Decode batches (one token per sequence) use 16-row query tiles and long K/V tiles (bandwidth);
    prefill uses 64-row tiles (K/V reuse) with 16-token K/V tiles. fp32 (FMA dots at full
    precision) uses smaller tiles and 8 warps. An fp8 cache is decoded through fp32 registers: its
    half-precision decode tiles are 32 tokens long. tests/test_kernels_compile.py checks for spills.
    """
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    head_pad = max(16, next_power_of_2(head_size))
    group_pad = next_power_of_2(group)
    half = element_size <= 2
    if num_tokens == num_seqs:   # head sizes above 128 (Gemma's 256) need 8 warps to keep 64-token tiles
        rows, tile_n, warps = 16, (64 if half else 16), (4 if half and head_pad <= 128 else 8)
        if fp8_cache and half:
            tile_n = 32
    else:
        rows = (32 if head_pad > 128 else 64) if half else 16
        tile_n, warps = 16, (4 if half else 8)
    block_m = max(rows, group_pad)
    return AttentionConfig(block_m=block_m, block_q=block_m // group, tile_n=tile_n, head_pad=head_pad,
                           num_splits=num_splits, num_warps=warps, num_stages=2)


def paged_attention_launches(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float, out: torch.Tensor,
                             config: AttentionConfig, sliding_window: Optional[int] = None,
                             softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                             k_scale: float = 1.0) -> list:
    """The launches of one call: the attention kernel, then the split merge when config splits (an fp8 cache's
    v_scale is applied to the output by the caller)."""
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    splits = config.num_splits
    if splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, splits, config.head_pad), dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out   # unused by the kernel
    sinks = out if sinks is None else sinks.to(torch.float32).contiguous()   # unused without HAS_SINKS
    cap = float(softcap) if softcap is not None else 1.0
    # The interpreter's bf16 tl.dot gives wrong numbers: upcast its operands to fp32 there.
    dot_fp32 = is_interpreted(paged_attention_kernel) and query.dtype == torch.bfloat16
    score_scale = float(scale) * float(k_scale)
    args = (out, query, cache_operand(key_cache), cache_operand(value_cache), block_tables, context_lens,
            query_start_loc, part_acc, part_max, part_sum, sinks, score_scale * LOG2E, score_scale / cap, cap * LOG2E,
            int(sliding_window or 0), num_seqs,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0))
    constexprs = dict(HEAD_SIZE=head_size, HEAD_PAD=config.head_pad, BLOCK_SIZE=block_size, GROUP=group,
                      BLOCK_M=config.block_m, BLOCK_Q=config.block_q, TILE_N=config.tile_n, NUM_SPLITS=splits,
                      DOT_FP32=dot_fp32, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                      HAS_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
                      HAS_SINKS=sinks is not out, KV_FORMAT=kv_format(key_cache.dtype))
    grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, splits)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    launches = [Launch(paged_attention_kernel, grid, args, constexprs, options)]
    if splits > 1:
        launches.append(Launch(combine_splits_kernel, (num_tokens, num_heads),
                               (out, part_acc, part_max, part_sum, sinks, out.stride(0), out.stride(1)),
                               dict(HEAD_SIZE=head_size, HEAD_PAD=config.head_pad, NUM_SPLITS=splits,
                                    HAS_SINKS=sinks is not out),
                               {"num_warps": 4}))
    return launches


def choose_config(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                  num_splits: Optional[int], sliding_window: Optional[int] = None) -> AttentionConfig:
    """Pick tiles from host-known shapes only (no device sync): tokens, sequences, table width (a decode
    query sees at most `sliding_window` keys)."""
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    if num_splits is None:
        bound = block_tables.shape[1] * block_size
        if sliding_window is not None:
            bound = min(bound, sliding_window)
        num_splits = auto_num_splits(num_tokens, num_seqs, num_kv_heads, bound, _sm_count(query.device))
    return attention_config(num_tokens, num_seqs, num_heads // num_kv_heads, head_size, num_splits,
                            query.element_size(), kv_format(key_cache.dtype) != 0)
