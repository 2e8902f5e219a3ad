"""What a KV cache entry holds: `value * (1 / scale)` in the cache's dtype, saturated to its finite range for fp8
(e4m3fn: +-448, e5m2: +-57344), so no value ever turns into NaN or infinity. One scale per layer and
tensor (K, V); 1.0 leaves values as they are. Shared by every implementation; the Triton kernels encode
and decode the same bits (see triton_fp8.py)."""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def quantize(values: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values as the cache stores them."""
    if scale != 1.0:   # times the float32 reciprocal, as the Triton kernel computes it (bit for bit)
        values = values.float() * (1.0 / scale)
    if is_fp8(cache_dtype):
        limit = FP8_MAX[cache_dtype]
        return values.float().clamp(-limit, limit).to(cache_dtype)
    return values.to(cache_dtype)


def dequantize(entries: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache entries back as values of `dtype`."""
    values = entries.to(dtype)
    return values if scale == 1.0 else values * scale


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or a uint8 view of it for fp8 (PyTorch implements few indexing copies for fp8)."""
    return tensor.view(torch.uint8) if is_fp8(tensor.dtype) else tensor


def check_scales(k_scale: float, v_scale: float) -> None:
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or scale == float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {scale!r}")
