"""fp8 cache entries in the Triton kernels, as raw bytes: encoding with round-to-nearest-even and decoding by
bit arithmetic (no fp8 types: they need sm_89+ and the interpreter lacks them), bit-exact with PyTorch's
`float32 -> float8_e4m3fn / float8_e5m2` conversion of values already saturated to the format's range
(kv_quant.py). Subnormals are built from integers, never from denormal floats, so flush-to-zero cannot
change them.

KV_FORMAT constexprs: 0 = a float cache read and written with `.to`, 1 = e4m3fn, 2 = e5m2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FLOAT, KV_E4M3, KV_E5M2 = 0, 1, 2
KV_FORMATS = {torch.float8_e4m3fn: KV_E4M3, torch.float8_e5m2: KV_E5M2}


def kv_format(dtype: torch.dtype) -> int:
    return KV_FORMATS.get(dtype, KV_FLOAT)


@triton.jit
def _round_half_even(t):
    """t (0 <= t < 2^22) rounded to the nearest integer, ties to even, as int32 (exact fp32 arithmetic)."""
    return ((t + 8388608.0) - 8388608.0).to(tl.int32)


@triton.jit
def encode_fp8(x, KV_FORMAT: tl.constexpr):
    """float32 values within the format's range -> fp8 bytes (uint8)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    if KV_FORMAT == 1:   # e4m3fn: bias 7, 3 mantissa bits, subnormals below 2^-6 in steps of 2^-9
        r = abits + 0x7FFFF + ((abits >> 20) & 1)
        normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
        code = tl.where(a < 0.015625, _round_half_even(tl.minimum(a, 0.015625) * 512.0), normal)
    else:                # e5m2: bias 15, 2 mantissa bits, subnormals below 2^-14 in steps of 2^-16
        r = abits + 0xFFFFF + ((abits >> 21) & 1)
        normal = (((r >> 23) - 112) << 2) | ((r >> 21) & 3)
        code = tl.where(a < 0.00006103515625, _round_half_even(tl.minimum(a, 0.00006103515625) * 65536.0),
                        normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_fp8(x, KV_FORMAT: tl.constexpr):
    """fp8 bytes (uint8) -> float32 values. NaN and infinity encodings decode as large finite numbers: written
    entries are saturated and never hold them, and handling them cost registers (a spill at head size 256)."""
    xi = x.to(tl.int32)
    mag = xi & 0x7F
    if KV_FORMAT == 1:
        normal = ((((mag >> 3) + 120) << 23) | ((mag & 7) << 20)).to(tl.float32, bitcast=True)
        f = tl.where(mag >= 8, normal, mag.to(tl.float32) * 0.001953125)
    else:
        normal = ((((mag >> 2) + 112) << 23) | ((mag & 3) << 21)).to(tl.float32, bitcast=True)
        f = tl.where(mag >= 4, normal, mag.to(tl.float32) * 0.0000152587890625)
    return tl.where((xi & 0x80) != 0, -f, f)


def cache_operand(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels receive for a cache: its bytes when it is fp8, else itself."""
    return cache.view(torch.uint8) if cache.dtype in KV_FORMATS else cache
