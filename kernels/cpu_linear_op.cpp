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
#include <tuple>
#include <vector>

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

int64_t kind_of(const at::Tensor& weight) {
  return weight.scalar_type() == at::kBFloat16 ? kBFloat16 : weight.scalar_type() == at::kHalf ? kFloat16 : kFloat32;
}

// The kernel's products of x with each weight: one parallel region for them all.
std::vector<at::Tensor> kernel_products(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                        const std::vector<std::optional<at::Tensor>>& biases) {
  const int64_t k = weights[0].size(1);
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  std::vector<at::Tensor> outs;
  std::vector<const void*> weight_data, bias_data;
  std::vector<void*> out_data;
  std::vector<int64_t> ns;
  for (size_t s = 0; s < weights.size(); ++s) {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = weights[s].size(0);
    outs.push_back(at::empty(sizes, x.options()));
    weight_data.push_back(weights[s].data_ptr());
    bias_data.push_back(biases[s].has_value() ? biases[s]->data_ptr() : nullptr);
    out_data.push_back(outs.back().data_ptr());
    ns.push_back(weights[s].size(0));
  }
  const int status = linear_rows_multi(rows.data_ptr(), m > 1 ? rows.stride(0) : k, weight_data.data(),
                                       bias_data.data(), out_data.data(), ns.data(),
                                       static_cast<int64_t>(weights.size()), m, k, kind_of(weights[0]),
                                       at::get_num_threads());
  TORCH_CHECK(status == 0, "linear_rows: the kernel refused its arguments");
  kernel_calls.fetch_add(1, std::memory_order_relaxed);
  return outs;
}

at::Tensor linear_rows_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           int64_t max_rows) {
  if (!kernel_takes(x, weight, bias, max_rows)) return at::linear(x, weight, bias);
  return kernel_products(x, {weight}, {bias})[0];
}

// `linear_rows` of several weights over the same x (the compiled forward's graph pass groups them,
// worker/linear_fusion.py): one call and one parallel region when the kernel takes every weight, else each alone.
std::vector<at::Tensor> linear_rows_group(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                          const std::vector<std::optional<at::Tensor>>& biases, int64_t max_rows) {
  bool takes = true;
  for (size_t s = 0; s < weights.size(); ++s)
    takes = takes && kernel_takes(x, weights[s], biases[s], max_rows) &&
            weights[s].scalar_type() == weights[0].scalar_type();
  if (takes) return kernel_products(x, weights, biases);
  std::vector<at::Tensor> outs;
  for (size_t s = 0; s < weights.size(); ++s) outs.push_back(linear_rows_cpu(x, weights[s], biases[s], max_rows));
  return outs;
}

// Fixed arities with one Tensor argument per weight and bias, so that inductor's C++ wrapper calls them through
// the dispatcher's stable interface like `linear_rows` (a Tensor[] argument or result would be a call into Python).
using OptTensor = std::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> linear_rows_2_cpu(const at::Tensor& x, const at::Tensor& w0, const OptTensor& b0,
                                                     const at::Tensor& w1, const OptTensor& b1, int64_t max_rows) {
  auto outs = linear_rows_group(x, {w0, w1}, {b0, b1}, max_rows);
  return {outs[0], outs[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_rows_3_cpu(const at::Tensor& x, const at::Tensor& w0,
                                                                 const OptTensor& b0, const at::Tensor& w1,
                                                                 const OptTensor& b1, const at::Tensor& w2,
                                                                 const OptTensor& b2, int64_t max_rows) {
  auto outs = linear_rows_group(x, {w0, w1, w2}, {b0, b1, b2}, max_rows);
  return {outs[0], outs[1], outs[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_rows_4_cpu(
    const at::Tensor& x, const at::Tensor& w0, const OptTensor& b0, const at::Tensor& w1, const OptTensor& b1,
    const at::Tensor& w2, const OptTensor& b2, const at::Tensor& w3, const OptTensor& b3, int64_t max_rows) {
  auto outs = linear_rows_group(x, {w0, w1, w2, w3}, {b0, b1, b2, b3}, max_rows);
  return {outs[0], outs[1], outs[2], outs[3]};
}

void set_streaming(bool on) { linear_rows_set_streaming(on ? 1 : 0); }

bool streaming() { return linear_rows_streaming() != 0; }

int64_t linear_rows_kernel_calls() { return kernel_calls.load(std::memory_order_relaxed); }

bool linear_rows_native_bfloat16() { return kNativeBFloat16; }

int64_t linear_rows_blocked_from(int64_t kind) {
  return kind == kBFloat16 ? gemm_min_rows<kBFloat16>() : kind == kFloat16 ? gemm_min_rows<kFloat16>()
                                                                           : gemm_min_rows<kFloat32>();
}

}  // namespace

TORCH_LIBRARY_IMPL(paged_backend, CPU, m) {
  m.impl("linear_rows", &linear_rows_cpu);
  m.impl("linear_rows_2", &linear_rows_2_cpu);
  m.impl("linear_rows_3", &linear_rows_3_cpu);
  m.impl("linear_rows_4", &linear_rows_4_cpu);
}

TORCH_LIBRARY_IMPL(paged_backend, CompositeExplicitAutograd, m) {
  m.impl("linear_rows_kernel_calls", &linear_rows_kernel_calls);
  m.impl("linear_rows_set_streaming", &set_streaming);
  m.impl("linear_rows_streaming", &streaming);
  m.impl("linear_rows_native_bfloat16", &linear_rows_native_bfloat16);
  m.impl("linear_rows_blocked_from", &linear_rows_blocked_from);
}
