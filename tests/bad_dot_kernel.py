"""A kernel the interpreter runs but the GPU compiler rejects (`tl.dot` with K = 8 < 16).

The compile-only test shows the AOT check fails on it; the interpreter checks show the interpreter
does not, which is why the compile check exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_backend.kernels.triton_launch import Launch


@triton.jit
def small_k_dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """c[M, N] = a[M, K] @ b[K, N] for one tile."""
    rows = tl.arange(0, M)
    inner = tl.arange(0, K)
    cols = tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * N + cols[None, :])
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], tl.dot(a, b))


def small_k_dot_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Launch:
    (m, k), n = a.shape, b.shape[1]
    return Launch(small_k_dot_kernel, (1,), (a, b, c), dict(M=m, K=k, N=n), {"num_warps": 4})
