"""Half-precision linear layers of the compiled forward through our CPU kernel (`kernels/cpu_linear.cpp`).

At batch 1 a decode step is a matrix-vector product per linear layer, bound by reading the weights; PyTorch's
bfloat16 and float16 products there reach a fraction of the memory bandwidth on CPUs without native
half-precision dot products (smollm2 bfloat16 decoded slower than float32 with half its bytes). In the compiled
forward each linear layer over CPU bfloat16/float16 weights is the operator `paged_backend::half_linear`, whose
C++ kernel (`kernels/cpu_linear_op.cpp`, no Python per call) runs ours (weights widened to float32 in registers,
float32 sums rounded once): for every step on CPUs whose half-precision matmuls oneDNN converts to float32, for
steps of up to 8 tokens where it runs them natively (PyTorch's GEMM beyond: `cpu_linear.max_rows`). Eager
steps keep PyTorch's linear, the one compared with transformers: the kernel adds in another order, so its results
may differ from transformers' in the last bit (docs/compilation.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_backend.kernels import cpu_linear

cpu_linear.define_ops()


@torch.library.register_fake("paged_backend::half_linear")
def _half_linear_shape(x, weight, bias, max_rows):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class HalfLinear(torch.nn.Linear):
    """An `nn.Linear` whose compiled forward is `paged_backend::half_linear`; eagerly it is `nn.Linear`."""

    half_max_rows = 0   # the operator's row limit for the kernel (cpu_linear.max_rows), set when swapped in

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.paged_backend.half_linear(input, self.weight, self.bias, self.half_max_rows)
        return F.linear(input, self.weight, self.bias)


def use_half_linear(model: torch.nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` over contiguous CPU bfloat16/float16 weights a `HalfLinear` (its
    class swapped in place: parameters, hooks and names stay); returns how many: 0 when it is turned off
    (`PAGED_BACKEND_HALF_LINEAR=0`) or the operator's kernel cannot be built (the reason logged once)."""
    if not cpu_linear.op_available():
        return 0
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is torch.nn.Linear and weight is not None and weight.device.type == "cpu"
                and weight.dtype in cpu_linear.HALF_KINDS and weight.is_contiguous()):
            module.__class__ = HalfLinear
            module.half_max_rows = cpu_linear.max_rows(weight.dtype)
            swapped += 1
    return swapped
