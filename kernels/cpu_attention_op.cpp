// `paged_backend::attend_layer` as a PyTorch operator with a C++ CPU kernel: the compiled forward calls it once per
// attention layer (30 calls per decode step of smollm2), and the Python operator it replaces cost 70-90 us per
// call in argument handling around a kernel of a few microseconds (2-3 ms of a 20-30 ms step).
//
// A step's metadata changes every step and the compiled graph does not capture it, so the caller sets it in this
// thread before the forward (`set_attention_caches`, `set_attention_plan` per sliding window, each plan checked
// by kernels/cpu.py's `plan_paged_attention` before it is set) and clears it after (`clear_attention_step`). A
// call the kernel takes (the step's plan for its window is set; float query, K/V of the cache's dtype, no fp8
// scales; shapes that fit the cache) writes the new K/V rows into their slots and attends through the block
// tables; any other call is `paged_backend::attend_layer_fallback` (the Python operator of worker/attention_op.py,
// which also sets the plan of a window it meets first). Schemas: kernels/cpu_attention_step.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <map>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_attention.cpp"

namespace {

struct StepPlan {
  at::Tensor tables, context_lens, query_start, slots;   // int64, contiguous, checked against the caches
  int64_t num_rows = 0;
};

struct StepState {
  std::vector<at::Tensor> key_caches, value_caches;
  std::map<int64_t, StepPlan> plans;   // by sliding window (0: none)
};

thread_local StepState step_state;
std::atomic<int64_t> kernel_calls{0};

std::optional<int64_t> cache_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kF32;
    case at::kDouble: return kF64;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return std::nullopt;   // fp8 caches carry scales: the fallback writes them
  }
}

bool new_rows_fit(const at::Tensor& rows, const at::Tensor& cache, int64_t tokens) {
  return rows.dim() == 4 && rows.size(0) == 1 && rows.size(1) == cache.size(2) && rows.size(2) == tokens &&
         rows.size(3) == cache.size(3) && rows.stride(3) == 1 && rows.scalar_type() == cache.scalar_type() &&
         rows.device().is_cpu();
}

// The plan for `window`, when the kernel takes this call; null otherwise.
const StepPlan* kernel_plan(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                            int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  const StepState& s = step_state;
  if (layer < 0 || layer >= static_cast<int64_t>(s.key_caches.size()) || window < 0) return nullptr;
  const auto plan = s.plans.find(window);
  if (plan == s.plans.end()) return nullptr;
  const at::Tensor& kc = s.key_caches[layer];
  const at::Tensor& vc = s.value_caches[layer];
  if (!cache_type(kc.scalar_type()) || kc.sizes() != vc.sizes() || kc.scalar_type() != vc.scalar_type() ||
      kc.stride(3) != 1 || vc.stride(3) != 1)
    return nullptr;
  if (query.dim() != 4 || query.size(0) != 1 || !query.device().is_cpu() || !at::isFloatingType(query.scalar_type()))
    return nullptr;
  const int64_t heads = query.size(1), tokens = query.size(2);
  if (tokens != plan->second.num_rows || tokens == 0 || query.size(3) != kc.size(3) || heads % kc.size(2) != 0)
    return nullptr;
  if (!new_rows_fit(key, kc, tokens) || !new_rows_fit(value, vc, tokens)) return nullptr;
  if (!std::isfinite(softcap) || softcap < 0) return nullptr;
  if (sinks.has_value() && (sinks->dim() != 1 || sinks->size(0) != heads || !sinks->device().is_cpu() ||
                            !at::isFloatingType(sinks->scalar_type())))
    return nullptr;
  return &plan->second;
}

at::Tensor fallback(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                    double scaling, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("paged_backend::attend_layer_fallback", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                               double, int64_t, double, const std::optional<at::Tensor>&)>();
  return op.call(query, key, value, layer, scaling, window, softcap, sinks);
}

// The query's rows as the kernel reads them, [tokens, heads, head_size] contiguous in the accumulator's type: the
// query itself when it is that already (float32 in transformers' layout), else a copy widened element by element
// into a per-thread buffer. A half-precision decode step met this 60 times (a query in and an output out per layer),
// and as ATen conversions (select, transpose, to, contiguous) they cost about 40 us per layer, 1.2 ms of a 21 ms
// bfloat16 step; widening is exact, so the kernel sees the same values.
template <typename To, typename From>
inline To cast_via_float(From v) {   // half precision through float32 (exact widening; rounding to nearest even)
  if constexpr (std::is_floating_point_v<From> && std::is_floating_point_v<To>) return static_cast<To>(v);
  else return static_cast<To>(static_cast<float>(v));
}

template <typename Acc, typename T>
void widen_rows(const at::Tensor& query, Acc* rows) {
  const T* q = static_cast<const T*>(query.data_ptr());
  const int64_t heads = query.size(1), tokens = query.size(2), d_size = query.size(3);
  const int64_t sh = query.stride(1), st = query.stride(2), sd = query.stride(3);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < d_size; ++d)
        rows[(t * heads + h) * d_size + d] = cast_via_float<Acc>(q[h * sh + t * st + d * sd]);
}

template <typename Acc>
const Acc* query_rows(const at::Tensor& query, std::vector<Acc>& buffer) {
  constexpr auto acc = std::is_same_v<Acc, double> ? at::kDouble : at::kFloat;
  const int64_t heads = query.size(1), tokens = query.size(2), d_size = query.size(3);
  const bool in_layout = (d_size == 1 || query.stride(3) == 1) && (heads == 1 || query.stride(1) == d_size) &&
                         (tokens == 1 || query.stride(2) == heads * d_size);
  if (query.scalar_type() == acc && in_layout) return static_cast<const Acc*>(query.data_ptr());
  buffer.resize(static_cast<size_t>(tokens * heads * d_size));
  switch (query.scalar_type()) {
    case at::kFloat: widen_rows<Acc, float>(query, buffer.data()); break;
    case at::kDouble: widen_rows<Acc, double>(query, buffer.data()); break;
    case at::kBFloat16: widen_rows<Acc, c10::BFloat16>(query, buffer.data()); break;
    case at::kHalf: widen_rows<Acc, c10::Half>(query, buffer.data()); break;
    default: return nullptr;
  }
  return buffer.data();
}

// The kernel's output [1, tokens, heads, head_size] in the query's dtype: written in place when that is the
// accumulator's type, else rounded from a per-thread buffer one element at a time (round to nearest even, as
// ATen's conversion).
template <typename T, typename Acc>
void narrow_rows(const Acc* src, at::Tensor& out) {
  T* dst = static_cast<T*>(out.data_ptr());
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = cast_via_float<T>(src[i]);
}

// query [1, heads, tokens, head_size], key/value [1, kv_heads, tokens, head_size] -> [1, tokens, heads, head_size].
template <typename Acc>
at::Tensor attend_layer_acc(const StepPlan& plan, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, int64_t layer, double scaling, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks) {
  constexpr auto acc = std::is_same_v<Acc, double> ? at::kDouble : at::kFloat;
  thread_local std::vector<Acc> query_buffer, out_buffer;
  const Acc* rows = query_rows<Acc>(query, query_buffer);
  if (rows == nullptr) return at::Tensor();
  const at::Tensor& kc = step_state.key_caches[layer];
  const at::Tensor& vc = step_state.value_caches[layer];
  const int64_t heads = query.size(1), tokens = query.size(2), d_size = query.size(3);
  at::Tensor out = at::empty({1, tokens, heads, d_size}, query.options());
  const bool out_in_place = query.scalar_type() == acc;
  if (!out_in_place) out_buffer.resize(static_cast<size_t>(out.numel()));
  Acc* out_data = out_in_place ? static_cast<Acc*>(out.data_ptr()) : out_buffer.data();
  std::optional<at::Tensor> sink_logits;
  if (sinks.has_value()) sink_logits = sinks->to(acc).contiguous();
  int64_t step[kStepFields];
  step[kTables] = reinterpret_cast<int64_t>(plan.tables.data_ptr());
  step[kTableWidth] = plan.tables.size(1);
  step[kContextLens] = reinterpret_cast<int64_t>(plan.context_lens.data_ptr());
  step[kQueryStart] = reinterpret_cast<int64_t>(plan.query_start.data_ptr());
  step[kNumSeqs] = plan.context_lens.size(0);
  step[kHeads] = heads;
  step[kKvHeads] = kc.size(2);
  step[kHeadSize] = kc.size(3);
  step[kBlockSize] = kc.size(1);
  step[kCacheType] = *cache_type(kc.scalar_type());
  for (int i = 0; i < 3; ++i) {
    step[kKeyStrides + i] = kc.stride(i);
    step[kValueStrides + i] = vc.stride(i);
  }
  step[kSlots] = reinterpret_cast<int64_t>(plan.slots.data_ptr());
  step[kNumTokens] = plan.num_rows;
  step[kElemBytes] = kc.element_size();
  step[kWindow] = window;
  step[kThreads] = at::get_num_threads();
  const void* sink_ptr = sink_logits.has_value() ? sink_logits->data_ptr() : nullptr;
  const int status = attend_and_cache<Acc>(step, rows, out_data, key.data_ptr(), value.data_ptr(), key.stride(2),
                                           key.stride(1), value.stride(2), value.stride(1), kc.data_ptr(),
                                           vc.data_ptr(), scaling, 1.0, softcap, sink_ptr);
  TORCH_CHECK(status == 0, "attend_layer: the CPU attention kernel failed with status ", status);
  if (!out_in_place) {
    switch (query.scalar_type()) {
      case at::kBFloat16: narrow_rows<c10::BFloat16>(out_data, out); break;
      case at::kHalf: narrow_rows<c10::Half>(out_data, out); break;
      case at::kFloat: narrow_rows<float>(out_data, out); break;
      default: narrow_rows<double>(out_data, out); break;
    }
  }
  kernel_calls.fetch_add(1, std::memory_order_relaxed);
  return out;
}

at::Tensor attend_layer_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                            double scaling, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  const StepPlan* plan = kernel_plan(query, key, value, layer, window, softcap, sinks);
  if (plan != nullptr) {
    at::Tensor out = query.scalar_type() == at::kDouble
                         ? attend_layer_acc<double>(*plan, query, key, value, layer, scaling, window, softcap, sinks)
                         : attend_layer_acc<float>(*plan, query, key, value, layer, scaling, window, softcap, sinks);
    if (out.defined()) return out;
  }
  return fallback(query, key, value, layer, scaling, window, softcap, sinks);
}

// False (and nothing set) unless every layer's caches are CPU tensors [num_blocks, block_size, kv_heads, head_size]
// of one number of blocks and block size, as the plans are checked against.
bool set_attention_caches(at::TensorList key_caches, at::TensorList value_caches) {
  step_state = StepState();
  if (key_caches.empty() || key_caches.size() != value_caches.size()) return false;
  const int64_t num_blocks = key_caches[0].dim() == 4 ? key_caches[0].size(0) : -1;
  const int64_t block_size = key_caches[0].dim() == 4 ? key_caches[0].size(1) : -1;
  for (size_t i = 0; i < key_caches.size(); ++i)
    for (const at::Tensor* cache : {&key_caches[i], &value_caches[i]})
      if (cache->dim() != 4 || !cache->device().is_cpu() || cache->size(0) != num_blocks ||
          cache->size(1) != block_size)
        return false;
  step_state.key_caches.assign(key_caches.begin(), key_caches.end());
  step_state.value_caches.assign(value_caches.begin(), value_caches.end());
  return true;
}

void set_attention_plan(int64_t window, const at::Tensor& tables, const at::Tensor& context_lens,
                        const at::Tensor& query_start, const at::Tensor& slots) {
  for (const at::Tensor* t : {&tables, &context_lens, &query_start, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "set_attention_plan: the plan's tensors must be contiguous int64 CPU tensors");
  const int64_t num_seqs = context_lens.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && query_start.numel() == num_seqs + 1,
              "set_attention_plan: tables [num_seqs, width] and query_start [num_seqs + 1] must fit context_lens");
  const int64_t rows = num_seqs ? query_start.data_ptr<int64_t>()[num_seqs] : 0;
  TORCH_CHECK(slots.numel() == rows, "set_attention_plan: ", slots.numel(), " slots for ", rows, " new tokens");
  TORCH_CHECK(!step_state.key_caches.empty() && window >= 0, "set_attention_plan: no caches set in this thread");
  const at::Tensor& cache = step_state.key_caches[0];
  const int64_t problem = check_step_metadata(tables.data_ptr<int64_t>(), tables.size(1),
                                              context_lens.data_ptr<int64_t>(), query_start.data_ptr<int64_t>(),
                                              num_seqs, slots.data_ptr<int64_t>(), rows, cache.size(1), cache.size(0),
                                              window);
  TORCH_CHECK(problem == 0, "set_attention_plan: the plan does not fit the caches (check_step code ", problem, ")");
  step_state.plans[window] = StepPlan{tables, context_lens, query_start, slots, rows};
}

void clear_attention_step() { step_state = StepState(); }

bool attention_step_set() { return !step_state.key_caches.empty(); }

int64_t attend_layer_kernel_calls() { return kernel_calls.load(std::memory_order_relaxed); }

}  // namespace

TORCH_LIBRARY_IMPL(paged_backend, CPU, m) { m.impl("attend_layer", &attend_layer_cpu); }

TORCH_LIBRARY_IMPL(paged_backend, CompositeExplicitAutograd, m) {
  m.impl("set_attention_caches", &set_attention_caches);
  m.impl("set_attention_plan", &set_attention_plan);
  m.impl("clear_attention_step", &clear_attention_step);
  m.impl("attention_step_set", &attention_step_set);
  m.impl("attend_layer_kernel_calls", &attend_layer_kernel_calls);
}
