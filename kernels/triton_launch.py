"""Launch plumbing shared by the Triton kernels: launch records, dtype maps, interpreter detection.

`triton.jit` decides between the GPU JIT and the CPU interpreter when a module is *imported*, and so
does Triton's own standard library (`tl.max`, `tl.sum`, `tl.cdiv` are themselves `@triton.jit`
functions): `TRITON_INTERPRET=1` must be set before `triton` is first imported in the process. The
tests therefore run the interpreter in a subprocess (tests/test_kernels_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """True when `kernel` was built by `triton.jit` in interpreter mode (runs on the CPU)."""
    return isinstance(kernel, InterpretedFunction)


@dataclass
class Launch:
    """One kernel launch, fully described: `run()` executes it; the compile check reuses it."""

    kernel: Any                     # a triton.jit kernel
    grid: Tuple[int, ...]
    args: Tuple[Any, ...]
    constexprs: Dict[str, Any]
    options: Dict[str, int] = field(default_factory=dict)   # num_warps, num_stages

    def run(self) -> None:
        if any(g == 0 for g in self.grid):
            return
        if not is_interpreted(self.kernel):
            for arg in self.args:
                if isinstance(arg, torch.Tensor) and arg.device.type != "cuda":
                    raise ValueError(f"{self.kernel.__name__}: compiled Triton kernels need CUDA tensors, got "
                                     f"{arg.device}; for the CPU set TRITON_INTERPRET=1 before importing triton")
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


_BITS_BY_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def tl_bits_dtype(dtype: torch.dtype):
    """An integer Triton dtype of the same width as `dtype`, for bit-exact copies."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _BITS_BY_SIZE:
        raise ValueError(f"dtype {dtype} has an unsupported element size {size}")
    return _BITS_BY_SIZE[size]
