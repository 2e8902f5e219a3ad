// `paged_backend::linear_rows` as a PyTorch operator with a C++ CPU kernel: the compiled forward calls it for
// every linear layer the kernel serves on this CPU (kernels/cpu_linear.py, `max_rows`), about 200 calls per
// decode step of a 30-layer model, and a Python implementation cost about 30 us per call in dispatch and argument
// handling, as much as the product itself at batch 1. This file is the one CPU source built against PyTorch's
// headers (cpu_build.py, `load_torch_ops`); the kernel is cpu_linear.cpp's, compiled into it.
//
// Operands the kernel takes (one dtype: bfloat16, float16 or float32, a contiguous [out, in] weight, at most
// `max_rows` rows of x when max_rows > 0) run it; any other call is PyTorch's `linear`. The schema is defined in
// Python (kernels/cpu_linear.py, `define_ops`) before this library is loaded.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <atomic>
#include <optional>

#include "cpu_linear.cpp"

namespace {

std::atomic<int64_t> kernel_calls{0};

bool kernel_takes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t max_rows) {
  const auto dtype = weight.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) || x.scalar_type() != dtype) return false;
  if (!x.device().is_cpu() || !weight.device().is_cpu() || weight.dim() != 2 || !weight.is_contiguous()) return false;
  if (x.dim() < 1 || x.size(-1) != weight.size(1) || weight.size(1) == 0) return false;
  if (bias.has_value() && (bias->scalar_type() != dtype || bias->dim() != 1 || !bias->is_contiguous() ||
                           bias->size(0) != weight.size(0) || !bias->device().is_cpu()))
    return false;
  const int64_t rows = x.numel() / weight.size(1);
  return rows >= 1 && (max_rows <= 0 || rows <= max_rows);
}

at::Tensor linear_rows_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           int64_t max_rows) {
  if (!kernel_takes(x, weight, bias, max_rows)) return at::linear(x, weight, bias);
  const int64_t k = weight.size(1), n = weight.size(0);
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t m = rows.size(0);
  const int status = linear_rows(rows.data_ptr(), m > 1 ? rows.stride(0) : k, weight.data_ptr(),
                                 bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(), n, m, n, k,
                                 weight.scalar_type() == at::kBFloat16 ? kBFloat16
                                 : weight.scalar_type() == at::kHalf  ? kFloat16
                                                                      : kFloat32,
                                 at::get_num_threads());
  TORCH_CHECK(status == 0, "linear_rows: the kernel refused its arguments");
  kernel_calls.fetch_add(1, std::memory_order_relaxed);
  return out;
}

int64_t linear_rows_kernel_calls() { return kernel_calls.load(std::memory_order_relaxed); }

}  // namespace

TORCH_LIBRARY_IMPL(paged_backend, CPU, m) { m.impl("linear_rows", &linear_rows_cpu); }

TORCH_LIBRARY_IMPL(paged_backend, CompositeExplicitAutograd, m) {
  m.impl("linear_rows_kernel_calls", &linear_rows_kernel_calls);
}
