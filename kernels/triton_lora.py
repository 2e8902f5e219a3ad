"""Triton kernels for a step's LoRA deltas over tokens of several adapters (a segmented gather matmul, as in
Punica's SGMV and S-LoRA): the tokens of each adapter slot form one segment of the plan's sorted order.

- `lora_shrink_kernel`, program (segment, row tile): `buf[m] = x[order[m]] @ A[slot]^T` in fp32, `[N, rank]`;
- `lora_expand_kernel`, program (segment, row tile, column tile): `y[order[m]] += scale[slot] * buf[m] @
  B[slot]^T`, each token's row written by exactly one program (a token belongs to one segment).
The adapters' weights are stacked per layer, `A` `[slots, max_rank, in]` and `B` `[slots, out, max_rank]`
(zero beyond an adapter's own rank); a slot whose scale is 0 (an adapter that does not target the layer) is
skipped. Only ever run here under TRITON_INTERPRET=1 and compiled for sm_80/sm_90 without a GPU
(tests/test_kernels_compile.py): it has never run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .lora import LoRAPlan
from .triton_launch import Launch, is_interpreted, next_power_of_2

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, buf_ptr, order_ptr, seg_starts_ptr, seg_slots_ptr, scales_ptr,
                       in_features, stride_xt, stride_al, stride_ar, stride_bm,
                       RANK: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """`buf[m, :rank] = x[order[m]] @ A[slot]^T` for the rows m of one tile of one segment."""
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    scale = tl.load(scales_ptr + slot)
    if (row0 < end) & (scale != 0.0):
        offs_m = row0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tokens = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, RANK_PAD)
        r_mask = offs_r < RANK
        acc = tl.zeros((BLOCK_M, RANK_PAD), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None],
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)   # A^T tile [BLOCK_K, RANK_PAD]
            if DOT_FP32:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += tl.dot(x, a, input_precision=PRECISION)
        tl.store(buf_ptr + offs_m[:, None] * stride_bm + offs_r[None, :], acc,
                 mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def lora_expand_kernel(y_ptr, b_ptr, buf_ptr, order_ptr, seg_starts_ptr, seg_slots_ptr, scales_ptr,
                       out_features, stride_yt, stride_bl, stride_bn, stride_bm,
                       RANK: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """`y[order[m], n-tile] += scale * buf[m] @ B[slot, n-tile]^T` for one tile of one segment."""
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    scale = tl.load(scales_ptr + slot)
    if (row0 < end) & (scale != 0.0):
        offs_m = row0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tokens = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, RANK_PAD)
        r_mask = offs_r < RANK
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_features
        t = tl.load(buf_ptr + offs_m[:, None] * stride_bm + offs_r[None, :],
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)            # fp32 [BLOCK_M, RANK_PAD]
        b = tl.load(b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)           # B^T tile [RANK_PAD, BLOCK_N]
        if DOT_FP32:
            b = b.to(tl.float32)
        else:
            t = t.to(b.dtype)
        delta = tl.dot(t, b, input_precision=PRECISION) * scale
        out_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoRAConfig:
    """Tiles of one call: rows per tile, the reduction tile of shrink, the column tile of expand."""

    block_m: int
    block_k: int
    block_n: int
    rank_pad: int
    num_warps: int


def lora_config(max_segment: int, max_rank: int, dtype: torch.dtype) -> LoRAConfig:
    """Decode steps (short segments) take 16-row tiles, prefills 64 rows (32 in fp32); ranks pad to a power of
    two >= 16 (tl.dot's smallest K and N)."""
    half = dtype != torch.float32
    block_m = 16 if max_segment <= 16 else (64 if half else 32)
    return LoRAConfig(block_m=block_m, block_k=64 if half else 32, block_n=64 if half else 32,
                      rank_pad=max(16, next_power_of_2(max_rank)), num_warps=4)


def _check(y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, a_stack: torch.Tensor, b_stack: torch.Tensor,
           scales: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[0] != plan.num_tokens:
        raise ValueError(f"x [T, in] and y [T, out] must have the plan's {plan.num_tokens} rows, got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype not in _DTYPES or y.dtype != x.dtype or a_stack.dtype != x.dtype or b_stack.dtype != x.dtype:
        raise ValueError(f"x, y and the adapter weights must share one dtype of {_DTYPES}, got {x.dtype}, "
                         f"{y.dtype}, {a_stack.dtype} and {b_stack.dtype}")
    slots, rank, in_features = a_stack.shape
    if b_stack.shape != (slots, y.shape[1], rank) or in_features != x.shape[1]:
        raise ValueError(f"A must be [slots, rank, {x.shape[1]}] and B [slots, {y.shape[1]}, rank], got "
                         f"{tuple(a_stack.shape)} and {tuple(b_stack.shape)}")
    if scales.shape != (slots,) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [{slots}], got {scales.dtype} {tuple(scales.shape)}")
    for name, tensor in (("x", x), ("y", y), ("A", a_stack), ("B", b_stack)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def lora_launches(y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, a_stack: torch.Tensor, b_stack: torch.Tensor,
                  scales: torch.Tensor) -> list:
    """The two launches of one call (shrink, expand), as data (the compile check builds them too)."""
    rank = a_stack.shape[1]
    config = lora_config(plan.max_segment, rank, x.dtype)
    buf = torch.empty((plan.num_lora_tokens, rank), dtype=torch.float32, device=x.device)
    dot_fp32 = x.dtype == torch.float32 or (is_interpreted(lora_shrink_kernel) and x.dtype == torch.bfloat16)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    segments = plan.seg_slots.shape[0]
    tiles = triton.cdiv(plan.max_segment, config.block_m)
    common = (plan.order, plan.seg_starts, plan.seg_slots, scales)
    flags = dict(RANK=rank, RANK_PAD=config.rank_pad, BLOCK_M=config.block_m, DOT_FP32=dot_fp32,
                 PRECISION=precision)
    options = {"num_warps": config.num_warps, "num_stages": 2}
    shrink = Launch(lora_shrink_kernel, (segments, tiles),
                    (x, a_stack, buf) + common + (x.shape[1], x.stride(0), a_stack.stride(0), a_stack.stride(1),
                                                  buf.stride(0)),
                    dict(flags, BLOCK_K=config.block_k), options)
    expand = Launch(lora_expand_kernel, (segments, tiles, triton.cdiv(y.shape[1], config.block_n)),
                    (y, b_stack, buf) + common + (y.shape[1], y.stride(0), b_stack.stride(0), b_stack.stride(1),
                                                  buf.stride(0)),
                    dict(flags, BLOCK_N=config.block_n), options)
    return [shrink, expand]


def lora_delta_triton(y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, a_stack: torch.Tensor,
                      b_stack: torch.Tensor, scales: torch.Tensor) -> None:
    """Add every slot's LoRA delta to its tokens' rows of `y` `[T, out]` in place (`x` `[T, in]`; `A`
    `[slots, max_rank, in]`, `B` `[slots, out, max_rank]`, `scales` float32 `[slots]`, 0 for slots to skip)."""
    _check(y, x, plan, a_stack, b_stack, scales)
    if plan.num_lora_tokens == 0:
        return
    for launch in lora_launches(y, x, plan, a_stack, b_stack, scales):
        launch.run()


__all__ = ["lora_config", "lora_delta_triton", "lora_expand_kernel", "lora_launches", "lora_shrink_kernel"]
