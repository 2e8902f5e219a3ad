// Linear layers at few rows on the CPU: out = x W^T (+ bias), weights in bfloat16, float16 or float32.
//
// A decode step at batch 1 reads every weight once and does two flops per weight: it is a matrix-vector product
// bound by memory bandwidth. PyTorch's products reach a fraction of the bandwidth there on some CPUs: bfloat16
// and float16 where the CPU has no native half-precision dot products (at more rows they take one dot product
// per output element), float32 where MKL runs on an AMD EPYC (11.8 GB/s of 33 at batch 1). This kernel streams
// four weight rows at a time, each read once for up to kMaxRows rows of x, widens half-precision weights to
// float32 in registers (bfloat16: a 16-bit shift; float16: F16C's conversion where the build targets it) and
// accumulates in float32. Half-precision results are rounded to the weights' dtype once (round to nearest even),
// as PyTorch's float32-accumulating half-precision GEMMs do; the order of the additions differs from theirs.
//
// Plain C++17 with GCC/Clang vector extensions and OpenMP (cpu_build.py builds it with -march=native).

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vector.h"

namespace {

using cpu_kernels::FloatVector;
using cpu_kernels::kVectorBytes;
constexpr int64_t L = cpu_kernels::Vector<float>::lanes;   // floats per vector
constexpr int64_t kMaxRows = 4;                             // rows of x per pass over the weights
constexpr int64_t kRowsPerTask = 16;                        // weight rows per OpenMP work item

typedef uint16_t HalfBits __attribute__((vector_size(kVectorBytes / 2)));
typedef uint32_t WideBits __attribute__((vector_size(kVectorBytes)));
typedef _Float16 HalfVector __attribute__((vector_size(kVectorBytes / 2)));

enum WeightKind : int64_t { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

// The element type of a kind's operands.
template <int64_t Kind>
using Element = typename std::conditional<Kind == kFloat32, float, uint16_t>::type;

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float f16_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t float_to_bf16(float f) {   // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline uint16_t float_to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

template <int64_t Kind>
inline FloatVector widen(const Element<Kind>* p) {
  if constexpr (Kind == kFloat32) {
    return cpu_kernels::load<float>(p);
  } else if constexpr (Kind == kBFloat16) {
    FloatVector f;
#if defined(__AVX512F__)   // one zero-extension and one shift (the generic code splits the register in two)
    const __m512 v = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    std::memcpy(&f, &v, sizeof f);
#elif defined(__AVX2__)
    const __m256 v = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    std::memcpy(&f, &v, sizeof f);
#else
    HalfBits h;
    std::memcpy(&h, p, sizeof h);
    const WideBits w = __builtin_convertvector(h, WideBits) << 16;
    std::memcpy(&f, &w, sizeof f);
#endif
    return f;
  } else {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    FloatVector v;
    std::memcpy(&v, &f, sizeof v);
    return v;
#elif defined(__F16C__)
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    FloatVector v;
    std::memcpy(&v, &f, sizeof v);
    return v;
#else
    HalfVector h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, FloatVector);
#endif
  }
}

template <int64_t Kind>
inline float widen_one(Element<Kind> h) {
  if constexpr (Kind == kFloat32) return h;
  else return Kind == kBFloat16 ? bf16_to_float(h) : f16_to_float(h);
}

template <int64_t Kind>
inline Element<Kind> narrow(float s) {
  if constexpr (Kind == kFloat32) return s;
  else return Kind == kBFloat16 ? float_to_bf16(s) : float_to_f16(s);
}

// Dot products of weight rows [j, j + R) with M rows of x (float32, row stride k): sums[m * n + j + r]. R rows
// at a time keep R independent streams of weights in flight (a matrix-vector product waits on memory, not on
// arithmetic) and load each x vector once for R rows.
template <int64_t Kind, int64_t M, int64_t R>
inline void dot_tile(const Element<Kind>* weight, int64_t k, const float* x, int64_t j, float* sums, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(Element<Kind>);   // elements per cache line
  const int64_t vec_end = k - k % L;
  const Element<Kind>* w = weight + j * k;
  FloatVector acc[R][M] = {};
  for (int64_t i = 0; i < vec_end; i += L) {
    FloatVector a[R];
    if (i % kLine == 0)   // once per 64-byte line: the next tile's rows, a tile ahead of the reads
      for (int64_t r = 0; r < R; ++r) __builtin_prefetch(w + (R + r) * k + i);
    for (int64_t r = 0; r < R; ++r) a[r] = widen<Kind>(w + r * k + i);
    for (int64_t m = 0; m < M; ++m) {
      const FloatVector xv = cpu_kernels::load<float>(x + m * k + i);
      for (int64_t r = 0; r < R; ++r) acc[r][m] += a[r] * xv;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) {
      float s = cpu_kernels::horizontal_sum<float>(acc[r][m]);
      for (int64_t i = vec_end; i < k; ++i) s += widen_one<Kind>(w[r * k + i]) * x[m * k + i];
      sums[m * n + j + r] = s;
    }
}

template <int64_t Kind, int64_t M>
void dot_rows(const Element<Kind>* weight, int64_t k, const float* x, int64_t n0, int64_t n1, float* sums, int64_t n) {
  constexpr int64_t R = M <= 2 ? 4 : 2;
  int64_t j = n0;
  for (; j + R <= n1; j += R) dot_tile<Kind, M, R>(weight, k, x, j, sums, n);
  for (; j < n1; ++j) dot_tile<Kind, M, 1>(weight, k, x, j, sums, n);
}

template <int64_t Kind>
void dot_block(int64_t rows, const Element<Kind>* weight, int64_t k, const float* x, int64_t n0, int64_t n1,
               float* sums, int64_t n) {
  switch (rows) {
    case 1: dot_rows<Kind, 1>(weight, k, x, n0, n1, sums, n); break;
    case 2: dot_rows<Kind, 2>(weight, k, x, n0, n1, sums, n); break;
    case 3: dot_rows<Kind, 3>(weight, k, x, n0, n1, sums, n); break;
    default: dot_rows<Kind, 4>(weight, k, x, n0, n1, sums, n); break;
  }
}

template <int64_t Kind>
void linear(const Element<Kind>* x, int64_t x_stride, const Element<Kind>* weight, const Element<Kind>* bias,
            Element<Kind>* out,
            int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t num_threads) {
  thread_local std::vector<float> wide, sums;   // x in float32, and the float32 results before rounding
  wide.resize(static_cast<size_t>(m * k));
  sums.resize(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) wide[r * k + i] = widen_one<Kind>(x[r * x_stride + i]);
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  float* const sum_data = sums.data();
  const float* const x_data = wide.data();
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t * kRowsPerTask, n1 = n0 + kRowsPerTask < n ? n0 + kRowsPerTask : n;
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t rows = m - r < kMaxRows ? m - r : kMaxRows;
      dot_block<Kind>(rows, weight, k, x_data + r * k, n0, n1, sum_data + r * n, n);
    }
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float s = sums[r * n + j];
      if (bias != nullptr) s += widen_one<Kind>(bias[j]);
      out[r * out_stride + j] = narrow<Kind>(s);
    }
}

}  // namespace

extern "C" {

// out[m, n] = x[m, k] W[n, k]^T (+ bias[n]), all of one kind (0: bfloat16, 1: float16, 2: float32); x and out
// have row strides, W and bias are contiguous. Returns 0, or -1 for an unknown kind or a bad size.
int linear_rows(const void* x, int64_t x_stride, const void* weight, const void* bias, void* out,
                int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t kind, int64_t num_threads) {
  if (m < 0 || n < 0 || k < 0 || x_stride < k || out_stride < n) return -1;
  if (kind == kBFloat16 || kind == kFloat16) {
    const auto* xs = static_cast<const uint16_t*>(x);
    const auto* ws = static_cast<const uint16_t*>(weight);
    const auto* bs = static_cast<const uint16_t*>(bias);
    auto* os = static_cast<uint16_t*>(out);
    if (kind == kBFloat16) linear<kBFloat16>(xs, x_stride, ws, bs, os, out_stride, m, n, k, num_threads);
    else linear<kFloat16>(xs, x_stride, ws, bs, os, out_stride, m, n, k, num_threads);
  } else if (kind == kFloat32) {
    linear<kFloat32>(static_cast<const float*>(x), x_stride, static_cast<const float*>(weight),
                     static_cast<const float*>(bias), static_cast<float*>(out), out_stride, m, n, k, num_threads);
  } else {
    return -1;
  }
  return 0;
}

}
