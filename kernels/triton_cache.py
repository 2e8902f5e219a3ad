"""Triton kernels that write the paged KV cache: `reshape_and_cache` and `copy_blocks`.

Cache layout (per layer): `[num_blocks, block_size, num_kv_heads, head_size]`, the last dimension
contiguous; slot = block * block_size + offset.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from .kv_quant import FP8_MAX, check_scales
from .triton_fp8 import cache_operand, encode_fp8, kv_format
from .triton_launch import Launch, next_power_of_2, tl_bits_dtype


@triton.jit
def _to_entries(x, inv_scale, limit, cache_ptr, KV_FORMAT: tl.constexpr, SCALED: tl.constexpr):
    """Values -> cache entries (kv_quant.py): times 1/scale, then the cache's dtype, or saturated and encoded
    for fp8 (whose cache arrives as bytes)."""
    if KV_FORMAT == 0:
        if SCALED:
            x = x.to(tl.float32) * inv_scale
        entries = x.to(cache_ptr.dtype.element_ty)
    else:
        y = x.to(tl.float32)
        if SCALED:
            y = y * inv_scale
        entries = encode_fp8(tl.minimum(tl.maximum(y, -limit), limit), KV_FORMAT)
    return entries


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_inv_scale, v_inv_scale, limit,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr, SCALED: tl.constexpr,
):
    """One program per new token: store its K and V `[num_kv_heads, head_size]` in its slot as cache entries
    (fp8 caches are passed as bytes and written through `encode_fp8`).

    A negative slot (padding) writes nothing.
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE) & (slot >= 0)
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, _to_entries(k, k_inv_scale, limit, key_cache_ptr, KV_FORMAT, SCALED), mask=mask)
    tl.store(v_dst, _to_entries(v, v_inv_scale, limit, value_cache_ptr, KV_FORMAT, SCALED), mask=mask)


@triton.jit
def copy_blocks_kernel(cache_ptrs_ptr, block_mapping_ptr, block_numel,
                       BITS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (pair, cache): copy block `src -> dst` of one cache, bit for bit, in CHUNK pieces.

    `cache_ptrs_ptr` holds the base address of every layer's key and value cache, so one launch
    covers all layers.
    """
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(BITS))
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64) * block_numel
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64) * block_numel
    offs = tl.arange(0, CHUNK)
    for start in range(0, block_numel, CHUNK):
        mask = start + offs < block_numel
        chunk = tl.load(base + src + start + offs, mask=mask)
        tl.store(base + dst + start + offs, chunk, mask=mask)


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")


def reshape_and_cache_launch(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> Launch:
    """Validate the inputs and describe the `reshape_and_cache` launch."""
    _check_cache("key_cache", key_cache)
    _check_cache("value_cache", value_cache)
    check_scales(k_scale, v_scale)
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
                         f"{tuple(value_cache.shape)} {value_cache.dtype} differ")
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    expected = (slot_mapping.shape[0], num_kv_heads, head_size)
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_size] = {expected}, "
                             f"got {tuple(tensor.shape)}")
        if tensor.device != key_cache.device:
            raise ValueError(f"{name} is on {tensor.device} but the cache is on {key_cache.device}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be a 1-D int32/int64 tensor")
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the cache is on {key_cache.device}")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    fmt = kv_format(key_cache.dtype)
    args = (key, value, cache_operand(key_cache), cache_operand(value_cache), slot_mapping,
            1.0 / float(k_scale), 1.0 / float(v_scale), FP8_MAX.get(key_cache.dtype, 0.0),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))
    constexprs = dict(NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEADS_PAD=next_power_of_2(num_kv_heads),
                      HEAD_PAD=next_power_of_2(head_size), BLOCK_SIZE=block_size, KV_FORMAT=fmt,
                      SCALED=k_scale != 1.0 or v_scale != 1.0)
    return Launch(reshape_and_cache_kernel, (slot_mapping.shape[0],), args, constexprs, {"num_warps": 4})


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_size]` into their cache slots (kv_quant.py)."""
    reshape_and_cache_launch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale).run()


def copy_blocks_launch(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                       block_mapping: torch.Tensor) -> Launch:
    """Validate the inputs and describe the one `copy_blocks` launch over all layers."""
    caches: List[torch.Tensor] = list(key_caches) + list(value_caches)
    if not caches:
        raise ValueError("copy_blocks needs at least one cache")
    first = caches[0]
    for cache in caches:
        _check_cache("every cache", cache)
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError("copy_blocks needs caches of one shape, dtype and device")
        if not cache.is_contiguous():
            raise ValueError("copy_blocks needs contiguous caches")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}")
    mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()
    pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    block_numel = first[0].numel()
    constexprs = dict(BITS=tl_bits_dtype(first.dtype), CHUNK=min(1024, next_power_of_2(block_numel)))
    return Launch(copy_blocks_kernel, (mapping.shape[0], len(caches)), (pointers, mapping, block_numel),
                  constexprs, {"num_warps": 4})


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy blocks `block_mapping[:, 0] -> block_mapping[:, 1]` in every layer (copy-on-write).

    Sources and destinations must be disjoint (copy-on-write always copies into fresh blocks).
    """
    if block_mapping.numel() == 0:
        return
    copy_blocks_launch(key_caches, value_caches, block_mapping).run()
