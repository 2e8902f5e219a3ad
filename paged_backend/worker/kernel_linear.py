"""Linear layers of the compiled forward through our CPU kernel (`kernels/cpu_linear.cpp`) where PyTorch's is slow.

At batch 1 a decode step is a matrix-vector product per linear layer, bound by reading the weights. PyTorch's
products reach a fraction of the memory bandwidth there on some CPUs: bfloat16 and float16 without native
half-precision dot products (smollm2 bfloat16 decoded slower than float32 with half its bytes; at more rows they
take one dot product per output element), float32 through MKL on an AMD EPYC. In the compiled forward each linear
layer whose weights the kernel serves on this CPU (`cpu_linear.max_rows`) is the operator
`paged_backend::linear_rows`, whose C++ kernel (`kernels/cpu_linear_op.cpp`, no Python per call) runs ours for
the steps the row limit allows and PyTorch's linear for longer ones. Eager steps keep PyTorch's linear, the one
compared with transformers: the kernel adds in another order, so its results may differ from transformers' in
the last bits (docs/compilation.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_backend.kernels import cpu_linear

cpu_linear.define_ops()


@torch.library.register_fake("paged_backend::linear_rows")
def _linear_rows_shape(x, weight, bias, max_rows):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _group_shapes(x, *weights_biases_rows):
    weights = weights_biases_rows[:-1:2]
    return tuple(x.new_empty((*x.shape[:-1], weight.shape[0])) for weight in weights)


for _count in cpu_linear.GROUP_SIZES:
    torch.library.register_fake(f"paged_backend::linear_rows_{_count}")(_group_shapes)


class KernelLinear(torch.nn.Linear):
    """An `nn.Linear` whose compiled forward is `paged_backend::linear_rows`; eagerly it is `nn.Linear`."""

    kernel_max_rows = 0   # the operator's row limit for the kernel (cpu_linear.max_rows), set when swapped in

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.paged_backend.linear_rows(input, self.weight, self.bias, self.kernel_max_rows)
        return F.linear(input, self.weight, self.bias)


def use_linear_kernel(model: torch.nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` over contiguous CPU weights of a dtype the kernel serves on this CPU
    (`cpu_linear.max_rows`) a `KernelLinear` (its class swapped in place: parameters, hooks and names stay);
    returns how many: 0 when it is turned off (`PAGED_BACKEND_LINEAR_KERNEL=0`) or the operator's kernel cannot be
    built (the reason logged once)."""
    if not cpu_linear.op_available():
        return 0
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is torch.nn.Linear and weight is not None and weight.device.type == "cpu"
                and weight.dtype in cpu_linear.DTYPES and weight.is_contiguous()):
            limit = cpu_linear.max_rows(weight.dtype)
            if limit is not None:
                module.__class__ = KernelLinear
                module.kernel_max_rows = limit
                swapped += 1
    return swapped


def stream_kernel_weights(model: torch.nn.Module) -> bool:
    """Have the kernel prefetch weights non-temporally when `model`'s weights exceed the last-level cache
    (`cpu_linear.stream_weights`; a process-wide hint, the sums do not change) and say whether it does now."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
    on = cpu_linear.stream_weights(weight_bytes)
    cpu_linear.set_streaming(on)
    return cpu_linear.streaming()
