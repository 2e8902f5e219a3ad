"""Linear layers through the compiled kernel (`cpu_linear.cpp`): bfloat16, float16 or float32 weights,
float32 sums (rounded once to a half-precision dtype), as the operator `torch.ops.paged_backend.linear_rows`
(defined here, its C++ kernel in `cpu_linear_op.cpp`, loaded by `op_available`) that the compiled forward calls,
with no Python per call; `max_rows` says for which dtypes and row counts this CPU runs it."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from .cpu_build import load_torch_ops

DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # the weights the kernel takes
# The kernel's row limit where PyTorch's own product is good beyond a few rows: half precision where oneDNN
# multiplies it natively (AMX, AVX512_BF16 / AVX512_FP16), float32 off Intel CPUs. Elsewhere PyTorch's
# half-precision products take one dot product per output element (smollm2's linear layers at 32 rows: 340 ms
# against the kernel's 64 on an AVX2 EPYC), so the kernel takes every row count.
FEW_ROWS = 8
# Float32 off Intel CPUs where the kernel is built for AVX2 (256-bit vectors): the kernel up to this many rows,
# MKL's GEMM beyond (smollm2's layers on an AVX2 EPYC: kernel / MKL 35 / 57 ms at 8 rows, 62 / 72 at 16, 86 / 78
# at 24). Built for AVX-512 the kernel takes every row count: its blocked product's panels are twice as wide and
# MKL stays slow (smollm2's layers on a 2-core AVX-512 EPYC, kernel / MKL: 32.7 / 46.2 ms at 8 rows, 38.8 / 76.8
# at 32, 82.1 / 148.5 at 64, 271.8 / 362.5 at 256).
FLOAT32_ROWS = 16
# Bfloat16 where the kernel is built for AVX512_BF16 and the CPU has no AMX: up to this many rows the kernel's
# `vdpbf16ps` products beat oneDNN's (smollm2's layers on a 2-core AVX-512 EPYC, kernel / oneDNN, medians of 3:
# 18.4 / 29.8 ms at 8 rows, 23.4 / 33.1 at 16, 25.0 / 46.9 at 32, 98.1 / 104.6 at 128; in one run 168 / 169 at
# 256 and 380 / 314 at 512: docs/compilation.md).
NATIVE_BFLOAT16_ROWS = 256
# Float32 on Intel CPUs where the kernel is built for AVX-512: the kernel up to this many rows, MKL's GEMM beyond.
# smollm2's 211 layers on a 2-core Xeon with AMX (random weights, q/k/v and gate/up grouped as in compiled code,
# medians of 5 alternating passes, kernel / MKL ms): 21.1 / 20.6 at 1 row, 20.9 / 21.7 at 2, 22.9 / 30.5 at 4,
# 26.6 / 35.2 at 8, 40.7 / 44.0 at 16, 42.8 / 52.0 at 32, 72.8 / 76.8 at 64, 137.0 / 113.4 at 128. In the
# compiled engine, batch-1 decode 24.6-25.0 against 25.0-25.9 ms a step (3 alternating processes; later, at a
# higher load, MKL ahead in 4 of 5 pairs: one row is a tie within the spread), and the anchor trace 248.5 against
# 222.0 output tok/s (one run each).
FLOAT32_INTEL_ROWS = 64
WIDE_VECTOR_BITS = 512   # the kernel's vector width from which float32 has no row limit off Intel


GROUP_SIZES = (2, 3, 4)   # the weights `linear_rows_N` takes: a layer's gate and up, q k v, a fourth projection


def group_schema(count: int) -> str:
    """`linear_rows_N`'s schema: a Tensor argument per weight and bias (not lists, and a tuple of results, not
    a list), so that inductor's C++ wrapper calls it through the dispatcher, not through Python."""
    pairs = ", ".join(f"Tensor w{i}, Tensor? b{i}" for i in range(count))
    return f"linear_rows_{count}(Tensor x, {pairs}, int max_rows) -> ({', '.join(['Tensor'] * count)})"


_operators: list = []   # the torch.library.Library defining the operators' schemas, kept alive


def define_ops() -> None:
    """Define `paged_backend::linear_rows(x, weight, bias, max_rows)` (the kernel for operands it takes and at most
    `max_rows` rows when max_rows > 0, PyTorch's linear otherwise), `paged_backend::linear_rows_N(x, w0, b0, ...,
    max_rows)` for N in GROUP_SIZES (N weights over one x in one parallel region, each output as `linear_rows`'s) and
    `paged_backend::linear_rows_kernel_calls()` (how often their kernel ran in this process),
    `paged_backend::linear_rows_native_bfloat16()` (whether it was built for AVX512_BF16) and
    `paged_backend::linear_rows_blocked_from(kind)` (from how many rows it runs its blocked product for weights of
    kind 0 bfloat16, 1 float16, 2 float32), once."""
    if not _operators:
        library = torch.library.Library("paged_backend", "FRAGMENT")
        library.define("linear_rows(Tensor x, Tensor weight, Tensor? bias, int max_rows) -> Tensor")
        for count in GROUP_SIZES:
            library.define(group_schema(count))
        library.define("linear_rows_kernel_calls() -> int")
        library.define("linear_rows_set_streaming(bool on) -> ()")
        library.define("linear_rows_streaming() -> bool")
        library.define("linear_rows_native_bfloat16() -> bool")
        library.define("linear_rows_blocked_from(int kind) -> int")
        _operators.append(library)


def op_available() -> bool:
    """Whether `torch.ops.paged_backend.linear_rows` has its C++ kernel (built and loaded on first call; False
    when it cannot be built, the reason logged once, or with `PAGED_BACKEND_LINEAR_KERNEL=0`)."""
    if not enabled():
        return False
    define_ops()
    return load_torch_ops("cpu_linear_op")


def kernel_calls() -> int:
    """How many calls of `torch.ops.paged_backend.linear_rows` ran the kernel in this process (0 without it)."""
    return int(torch.ops.paged_backend.linear_rows_kernel_calls()) if op_available() else 0


def set_streaming(on: bool) -> None:
    """Prefetch the weights of one-to-few-row products non-temporally (on) or into every cache level (off, the
    default), for the whole process: a hint, the sums are the same either way (see `stream_weights`)."""
    if op_available():
        torch.ops.paged_backend.linear_rows_set_streaming(bool(on))


def streaming() -> bool:
    """Whether the kernel prefetches weights non-temporally now (False without the kernel)."""
    return bool(torch.ops.paged_backend.linear_rows_streaming()) if op_available() else False


def stream_weights(weight_bytes: int, cache_bytes: Optional[int] = None) -> bool:
    """Whether a model of `weight_bytes` should stream its weights past the caches: when they exceed the last-level
    cache (`cache_bytes`, this machine's by default; unknown: no). A batch-1 decode step then reads every weight
    from memory whatever it does, and prefetched into every level the weights evict what the rest of the step
    runs on each step (smollm2 compiled on a 2-core AVX-512 EPYC with a 32 MiB L3, one process switching the hint:
    1-10% off a batch-1 step over four runs, the sampling after the forward faster in each; docs/compilation.md).
    A model that fits keeps its weights cached from step to step instead."""
    if cache_bytes is None:
        cache_bytes = last_level_cache_bytes()
    return cache_bytes is not None and weight_bytes > cache_bytes


@lru_cache(maxsize=None)
def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> Optional[int]:
    """The largest CPU cache of cpu0 as Linux reports it (`root`/index*/size, e.g. "32768K"), None if unknown."""
    sizes = []
    for index in Path(root).glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def native_bfloat16() -> bool:
    """Whether the kernel multiplies bfloat16 with AVX512_BF16's `vdpbf16ps` (built for a CPU that has it)."""
    return bool(torch.ops.paged_backend.linear_rows_native_bfloat16()) if op_available() else False


def blocked_from_rows(dtype: torch.dtype) -> int:
    """From how many rows of x the kernel runs its blocked product over `dtype` weights rather than dot products
    (16; where it was built for 512-bit vectors 2 for float32, 3 for bfloat16 through AVX512_BF16, else 8): from
    there on an output row does not depend on the call's other rows."""
    if dtype not in DTYPES:
        raise ValueError(f"blocked_from_rows is for bfloat16, float16 and float32, not {dtype}")
    if not op_available():
        raise RuntimeError("the linear kernel is not available on this machine")
    return int(torch.ops.paged_backend.linear_rows_blocked_from(DTYPES.index(dtype)))   # the kernel's kinds 0, 1, 2


def enabled() -> bool:
    """`PAGED_BACKEND_LINEAR_KERNEL=0` keeps PyTorch's linear in compiled code too (for comparison, debugging)."""
    value = os.environ.get("PAGED_BACKEND_LINEAR_KERNEL", "1").strip().lower()
    if value not in ("0", "1", "off", "on", ""):
        raise ValueError(f"PAGED_BACKEND_LINEAR_KERNEL must be 1/on or 0/off, got {value!r}")
    return value in ("1", "on", "")


@lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD; "" where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                return value.strip()
    except OSError:
        pass
    return ""


def max_rows(dtype: torch.dtype) -> Optional[int]:
    """For which steps compiled linear layers over `dtype` weights run the kernel on this CPU: None for none,
    0 for all, n for steps of at most n tokens. Half precision: FEW_ROWS where oneDNN has native `dtype`
    matmuls, else all; bfloat16 NATIVE_BFLOAT16_ROWS where the kernel has AVX512_BF16 and the CPU no AMX (with
    AMX it stays FEW_ROWS: oneDNN's AMX tiles were never measured against this kernel). Float32 on Intel CPUs:
    FLOAT32_INTEL_ROWS where the kernel has 512-bit vectors (MKL's GEMM is faster from 128 rows), none with
    narrower vectors (not measured); elsewhere all where the kernel has 512-bit vectors and FLOAT32_ROWS otherwise
    (MKL on an AMD EPYC reads 11.8 GB/s of 33 at batch 1, the kernel 20.8)."""
    from .cpu_features import cpu_features, kernel_vector_bits, onednn_half_matmuls

    if dtype == torch.float32:
        wide = (kernel_vector_bits() or 0) >= WIDE_VECTOR_BITS
        if cpu_vendor() == "GenuineIntel":
            return FLOAT32_INTEL_ROWS if wide else None
        return 0 if wide else FLOAT32_ROWS
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
    if name is None:
        raise ValueError(f"max_rows is for bfloat16, float16 and float32, not {dtype}")
    if not onednn_half_matmuls()[name]:
        return 0
    if dtype == torch.bfloat16 and native_bfloat16() and not cpu_features().has("amx_bf16"):
        return NATIVE_BFLOAT16_ROWS
    return FEW_ROWS
