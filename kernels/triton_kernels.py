"""The Triton implementations behind `paged_backend.kernels` (same signatures as `reference`).

On CUDA tensors they run compiled; with `TRITON_INTERPRET=1` they run on the CPU in Triton's
interpreter (slow; for tests). See docs/kernels.md for grids, tiling and the cache layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_attention import choose_config, paged_attention_launches
from .kv_quant import FP8_MAX, check_scales
from .triton_cache import copy_blocks, reshape_and_cache
from .variant import check_attention_variant

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = _FLOAT_DTYPES + tuple(FP8_MAX)


def _check_attention_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, out: Optional[torch.Tensor]) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_size], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_heads, head_size = query.shape[1:]
    num_kv_heads, cache_head_size = key_cache.shape[2:]
    if head_size != cache_head_size:
        raise ValueError(f"query head_size {head_size} != cache head_size {cache_head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype must be one of {_FLOAT_DTYPES}, got {query.dtype}")
    if key_cache.dtype not in _CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"the caches must share one dtype of {_CACHE_DTYPES}, got {key_cache.dtype} and "
                         f"{value_cache.dtype}")
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    num_seqs = context_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                         f"got {tuple(query_start_loc.shape)}")
    for name, tensor in (("block_tables", block_tables), ("context_lens", context_lens),
                         ("query_start_loc", query_start_loc)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    if key_cache.device != query.device or value_cache.device != query.device:
        raise ValueError("query and caches must be on one device")
    if out is not None and (out.shape != query.shape or out.stride(-1) != 1 or out.device != query.device):
        raise ValueError(f"out must be like query {tuple(query.shape)} with a contiguous last dimension")


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, out: Optional[torch.Tensor] = None,
                    num_splits: Optional[int] = None, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of `query` `[num_tokens, num_heads, head_size]` over each sequence's paged context,
    optionally windowed, soft-capped and with sinks (see variant.py). The cache may hold fp16, bf16, fp32 or
    fp8 (e4m3fn / e5m2 entries times k_scale / v_scale), converted to the query's dtype as it is read.

    `num_splits` forces the number of split-KV segments (a power of two); None picks it from the
    batch shape (split only for decode batches too small to fill the GPU).
    """
    _check_attention_inputs(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, out)
    check_attention_variant(query.shape[1], query.device, sliding_window, softcap, sinks)
    check_scales(k_scale, v_scale)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0 or context_lens.shape[0] == 0:
        return out
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables has no columns but there are sequences to attend")
    block_tables = block_tables.to(torch.int32)
    context_lens = context_lens.to(torch.int32)
    query_start_loc = query_start_loc.to(torch.int32)
    config = choose_config(query, key_cache, block_tables, num_splits, sliding_window)
    for launch in paged_attention_launches(query, key_cache, value_cache, block_tables, context_lens,
                                           query_start_loc, scale, out, config, sliding_window, softcap, sinks,
                                           k_scale):
        launch.run()
    if v_scale != 1.0:   # outside the kernel: an extra runtime argument cost the bf16 decode kernel a spill
        out.mul_(v_scale)
    return out


__all__ = ["copy_blocks", "paged_attention", "reshape_and_cache"]
