// Linear layers on the CPU: out = x W^T (+ bias), weights in bfloat16, float16 or float32.
//
// A decode step at batch 1 reads every weight once and does two flops per weight: it is a matrix-vector product
// bound by memory bandwidth. PyTorch's products reach a fraction of the bandwidth there on some CPUs: bfloat16
// and float16 where the CPU has no native half-precision dot products (at more rows they take one dot product
// per output element), float32 where MKL runs on an AMD EPYC (11.8 GB/s of 33 at batch 1). This kernel streams
// four weight rows at a time, each read once for up to kMaxRows rows of x (8 with AVX-512, else 4), widens
// half-precision weights to float32 in registers (bfloat16: a 16-bit shift; float16: F16C's conversion where the
// build targets it) and accumulates in float32. Half-precision results are rounded to the weights' dtype once
// (round to nearest even), as PyTorch's float32-accumulating half-precision GEMMs do; the order of the additions
// differs from theirs.
//
// From gemm_min_rows rows of x on (16; with AVX-512 float32 2, bfloat16 3, float16 8), a blocked product replaces
// the dot products (`gemm`): x packed once per call into panels of 2 vectors of rows (the last one of 1 or, with
// AVX-512, half a vector where no more rows are left), each work item's weight rows widened once to float32, and a
// register tile of 6 weight rows by the panel's vectors that broadcasts one weight and loads the vectors of x per
// step (no widening or horizontal sums in the inner loop).
//
// Built for AVX512_BF16, bfloat16 from two rows on multiplies pairs of bfloat16 with `vdpbf16ps` instead (below).
//
// Plain C++17 with GCC/Clang vector extensions and OpenMP (cpu_build.py builds it with -march=native); the
// AVX512_BF16 path with its intrinsics.

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vector.h"

namespace {

using cpu_kernels::FloatVector;
using cpu_kernels::kVectorBytes;
constexpr int64_t L = cpu_kernels::Vector<float>::lanes;   // floats per vector
// Rows of x per pass over a work item's weights: 4 (8 accumulators of 2 weight rows by 4) where there are 16
// vector registers, 8 (16 of 2 by 8) with AVX-512's 32 (float16 and bfloat16 widened below 8 rows; from
// gemm_min_rows rows on the blocked product takes over). An output's sum does not depend on the pass.
constexpr int64_t kMaxRows = L >= 16 ? 8 : 4;
constexpr int64_t kRowsPerTask = 16;                        // weight rows per OpenMP work item

typedef uint16_t HalfBits __attribute__((vector_size(kVectorBytes / 2)));
typedef uint32_t WideBits __attribute__((vector_size(kVectorBytes)));
typedef _Float16 HalfVector __attribute__((vector_size(kVectorBytes / 2)));

enum WeightKind : int64_t { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

// Whether the products that read each weight once (one to a few rows of x) prefetch it non-temporally
// (`prefetchnta`): a batch-1 decode step of a model larger than the last-level cache streams every weight once,
// and prefetched into every level it evicts what the rest of the step runs on (the interpreter, the dispatcher,
// the sampler), which then runs from memory each step. Set per process (`linear_rows_set_streaming`) by whoever
// knows the model's size; a hint only, the sums are the same either way.
std::atomic<bool> stream_weights{false};

inline void prefetch_weights(const void* p) {
  if (stream_weights.load(std::memory_order_relaxed)) __builtin_prefetch(p, 0, 0);   // x86: prefetchnta
  else __builtin_prefetch(p);
}

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
      for (int64_t r = 0; r < R; ++r) prefetch_weights(w + (R + r) * k + i);
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

// One weight row's dot product with one row of x, read front to back with four accumulators along k (element i
// goes to accumulator (i / L) % 4) and a software prefetch 1 KiB ahead: consecutive rows make one sequential
// stream per thread, which the hardware prefetchers follow better than dot_tile's four interleaved rows when rows
// are short (on a 2-core AVX2 EPYC, 1-row products over 576-wide rows: bfloat16 28 -> 34-39 GB/s, float32 39 ->
// 43; over 1536-wide rows the tiles stay faster). The order of its additions differs from dot_tile's, so a row's
// result may differ in the last bits between a 1-row product and a product of more rows.
template <int64_t Kind>
inline float dot_row(const Element<Kind>* w, int64_t k, const float* x) {
  constexpr int64_t kLine = 64 / sizeof(Element<Kind>);
  constexpr int64_t kAhead = 1024 / sizeof(Element<Kind>);
  constexpr int64_t kStep = 4 * L;
  FloatVector a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kStep <= k; i += kStep) {
    for (int64_t p = 0; p < kStep; p += kLine) prefetch_weights(w + i + p + kAhead);
    a0 += widen<Kind>(w + i) * cpu_kernels::load<float>(x + i);
    a1 += widen<Kind>(w + i + L) * cpu_kernels::load<float>(x + i + L);
    a2 += widen<Kind>(w + i + 2 * L) * cpu_kernels::load<float>(x + i + 2 * L);
    a3 += widen<Kind>(w + i + 3 * L) * cpu_kernels::load<float>(x + i + 3 * L);
  }
  for (; i + L <= k; i += L) a0 += widen<Kind>(w + i) * cpu_kernels::load<float>(x + i);
  float s = cpu_kernels::horizontal_sum<float>((a0 + a1) + (a2 + a3));
  for (; i < k; ++i) s += widen_one<Kind>(w[i]) * x[i];
  return s;
}

// The longest rows (in elements) that one-row products read row by row (dot_row) rather than in tiles; bfloat16
// through vdpbf16ps (dot_row_bf16) up to twice as many, the same 4 KiB per row (smollm2's 1536-wide down
// projections at 1 row on a 2-core AVX-512 EPYC, one process alternating two builds, weights from memory: 1.91
// against 2.37 ms for the 30 layers in float32 FMA tiles; float32 read row by row there was slower, 4.29 against 3.77).
constexpr int64_t kRowByRowMaxK = 1024;
constexpr int64_t kRowByRowMaxKBf16 = 2048;

template <int64_t Kind, int64_t M>
void dot_rows(const Element<Kind>* weight, int64_t k, const float* x, int64_t n0, int64_t n1, float* sums, int64_t n) {
  if (M == 1 && k <= kRowByRowMaxK) {
    for (int64_t j = n0; j < n1; ++j) sums[j] = dot_row<Kind>(weight + j * k, k, x);
    return;
  }
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
    case 4: dot_rows<Kind, 4>(weight, k, x, n0, n1, sums, n); break;
    case 5: dot_rows<Kind, 5>(weight, k, x, n0, n1, sums, n); break;
    case 6: dot_rows<Kind, 6>(weight, k, x, n0, n1, sums, n); break;
    case 7: dot_rows<Kind, 7>(weight, k, x, n0, n1, sums, n); break;
    default: dot_rows<Kind, 8>(weight, k, x, n0, n1, sums, n); break;
  }
}

// ---- bfloat16 through AVX512_BF16 --------------------------------------------------------------------------------
//
// Where the build targets AVX512_BF16, bfloat16 products of two rows of x and more go to `vdpbf16ps` without
// widening: it multiplies 16 pairs of bfloat16 per vector and adds each pair's two products to one float32 lane,
// twice the multiply-adds of a float32 FMA per instruction (smollm2's layers on a 2-core AVX-512 EPYC at 32 rows:
// 25 against 53 ms; docs/compilation.md). A product of two bfloat16 is exact in float32; the additions round to
// float32 (nearest even) as the FMAs above do, but in pairs, so the bits may differ from a build without
// AVX512_BF16; operands and sums below float32's normal range count as zero (the instruction's DAZ/FTZ).
#if defined(__AVX512BF16__)
constexpr bool kNativeBFloat16 = true;
#else
constexpr bool kNativeBFloat16 = false;
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kBf16Lanes = 32;   // bfloat16 per vector

inline __m512bh bf16_load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh bf16_load_first(const uint16_t* p, int64_t count) {   // the first `count` (< 32), zeros after
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << count) - 1u), p);
}

// dot_tile's products for bfloat16 x (row stride k): sums[m * n + j + r] for weight rows [j, j + R).
template <int64_t M, int64_t R>
inline void dot_tile_bf16(const uint16_t* weight, int64_t k, const uint16_t* x, int64_t j, float* sums, int64_t n) {
  const int64_t vec_end = k - k % kBf16Lanes;
  const uint16_t* w = weight + j * k;
  __m512 acc[R][M];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += kBf16Lanes) {   // one 64-byte line of each row per step
    for (int64_t r = 0; r < R; ++r) prefetch_weights(w + (R + r) * k + i);
    __m512bh a[R];
    for (int64_t r = 0; r < R; ++r) a[r] = bf16_load(w + r * k + i);
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh xv = bf16_load(x + m * k + i);
      for (int64_t r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], a[r], xv);
    }
  }
  if (vec_end < k) {
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh xv = bf16_load_first(x + m * k + vec_end, k - vec_end);
      for (int64_t r = 0; r < R; ++r)
        acc[r][m] = _mm512_dpbf16_ps(acc[r][m], bf16_load_first(w + r * k + vec_end, k - vec_end), xv);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) sums[m * n + j + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// dot_row for bfloat16 x through vdpbf16ps: one weight row front to back, two lines per step into two
// accumulators, a software prefetch 1 KiB ahead (one sequential stream per thread, as dot_row); no widening.
inline float dot_row_bf16(const uint16_t* w, int64_t k, const uint16_t* x) {
  constexpr int64_t kAhead = 1024 / 2;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * kBf16Lanes <= k; i += 2 * kBf16Lanes) {
    prefetch_weights(w + i + kAhead);
    prefetch_weights(w + i + kBf16Lanes + kAhead);
    a0 = _mm512_dpbf16_ps(a0, bf16_load(w + i), bf16_load(x + i));
    a1 = _mm512_dpbf16_ps(a1, bf16_load(w + i + kBf16Lanes), bf16_load(x + i + kBf16Lanes));
  }
  if (i + kBf16Lanes <= k) {
    a0 = _mm512_dpbf16_ps(a0, bf16_load(w + i), bf16_load(x + i));
    i += kBf16Lanes;
  }
  if (i < k) a1 = _mm512_dpbf16_ps(a1, bf16_load_first(w + i, k - i), bf16_load_first(x + i, k - i));
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

template <int64_t M>
void dot_rows_bf16(const uint16_t* weight, int64_t k, const uint16_t* x, int64_t n0, int64_t n1, float* sums,
                   int64_t n) {
  if (M == 1 && k <= kRowByRowMaxKBf16) {
    for (int64_t j = n0; j < n1; ++j) sums[j] = dot_row_bf16(weight + j * k, k, x);
    return;
  }
  constexpr int64_t R = M <= 2 ? 4 : 2;
  int64_t j = n0;
  for (; j + R <= n1; j += R) dot_tile_bf16<M, R>(weight, k, x, j, sums, n);
  for (; j < n1; ++j) dot_tile_bf16<M, 1>(weight, k, x, j, sums, n);
}
#endif

// dot_block for bfloat16 operands through AVX512_BF16 (x in bfloat16, row stride k).
inline void dot_block_bf16(int64_t rows, const uint16_t* weight, int64_t k, const uint16_t* x, int64_t n0, int64_t n1,
                           float* sums, int64_t n) {
#if defined(__AVX512BF16__)
  switch (rows) {
    case 1: dot_rows_bf16<1>(weight, k, x, n0, n1, sums, n); break;
    case 2: dot_rows_bf16<2>(weight, k, x, n0, n1, sums, n); break;
    case 3: dot_rows_bf16<3>(weight, k, x, n0, n1, sums, n); break;
    case 4: dot_rows_bf16<4>(weight, k, x, n0, n1, sums, n); break;
    case 5: dot_rows_bf16<5>(weight, k, x, n0, n1, sums, n); break;
    case 6: dot_rows_bf16<6>(weight, k, x, n0, n1, sums, n); break;
    case 7: dot_rows_bf16<7>(weight, k, x, n0, n1, sums, n); break;
    default: dot_rows_bf16<8>(weight, k, x, n0, n1, sums, n); break;
  }
#else
  (void)rows, (void)weight, (void)k, (void)x, (void)n0, (void)n1, (void)sums, (void)n;
#endif
}

// One weight of a product over a shared x: its n rows, bias (or null) and contiguous [m, n] output.
template <int64_t Kind>
struct Segment {
  const Element<Kind>* weight;
  const Element<Kind>* bias;
  Element<Kind>* out;
  int64_t n;
};

// ---- Many rows: a blocked product --------------------------------------------------------------------------------
//
// The dot products above widen every weight again for each 4 rows of x and end each output with a horizontal sum;
// at 16 rows and more they keep the FMA units half busy (smollm2's layers in bfloat16 on a 2-core AVX2 EPYC at
// 128 rows: 82-111 GFLOP/s of a 204 peak). Here each output is one float32 sum over k in order (one FMA chain per
// output lane), computed in a register tile of kTileN weight rows by kPanel rows of x: a result does not depend on
// the other rows of the call, but its bits may differ from the dot products' at fewer rows.
//
// Where at most one vector of rows is left after the whole panels (16 rows at a decode step of 16 sequences, the
// last 16 of 48), the last panel is one vector wide (`gemm_tile_narrow`), and with AVX-512 half a vector where at
// most 8 are left (`gemm_tile_quarter`): a panel of two vectors half of zeros cost as much as a full one (smollm2's
// float32 layers on a 2-core AVX-512 EPYC: 45.0 ms at 16 rows, 46.0 at 32); float32 rows of 17 to 24 left take one
// panel of each (PanelLayout). Each output lane is the same FMA chain over k in any of them, so the bits do not
// change.

constexpr int64_t kPanel = 2 * L;        // rows of x per panel: two vectors
constexpr int64_t kTileN = 6;            // weight rows per register tile (12 accumulators, 15 of 16 AVX2 registers)
constexpr int64_t kGemmTask = 4 * kTileN;   // weight rows per OpenMP work item
// Rows of x from which the blocked product runs: 16, and with AVX-512 (a panel of one vector holds 16 rows, half a
// vector 8) fewer where it beats passes of dot products. Float32 from 2 rows (smollm2's layers on a 2-core AVX-512
// EPYC, one process alternating two builds, weights from memory: 20.6 against 22.6 ms at 2 rows, 21.7 against 27.4
// at 4, 22.7 against 33.3 at 8). Bfloat16 through AVX512_BF16 from 3 (its `vdpbf16ps` dot products against the
// blocked product, both orders of the two builds: 17.1 / 17.6 and 16.1 / 16.1 ms at 2 rows, 17.8 / 17.0 and 18.0 /
// 17.7 at 3, 20.4 / 18.6 and 18.7 / 16.7 at 4; 18.5, 20.1 and 17.6 at 5, 6 and 8 against 16.4-17.8 blocked). Weights
// the kernel widens (float16; bfloat16 without AVX512_BF16) from 8: the blocked product widens them into a copy, and
// passes of up to eight rows stay faster below (float16, dot products / blocked, both orders of the two builds but
// at 2: 15.2 / 22.5 ms at 2 rows, 22.6 / 30.4 and 21.0 / 31.7 at 5; 28.8 / 24.7 and 25.2 / 25.6 at 8, 31.6 / 30.8
// and 37.8 / 30.2 at 12; this probe favours the build it loads first by up to a quarter at these sizes).
constexpr int64_t kGemmMinRows = 16;
template <int64_t Kind>
constexpr int64_t gemm_min_rows() {
  if (L < 16) return kGemmMinRows;
  if (Kind == kFloat32) return 2;
  return Kind == kBFloat16 && kNativeBFloat16 ? 3 : 8;
}

inline FloatVector broadcast(const float* p) {   // a load that fills every lane (vbroadcastss from memory)
#if defined(__AVX512F__)
  const __m512 v = _mm512_set1_ps(*p);
#elif defined(__AVX__)
  const __m256 v = _mm256_broadcast_ss(p);
#else
  FloatVector v;
  for (int64_t i = 0; i < L; ++i) v[i] = *p;
  return v;
#endif
  FloatVector f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}

// How x's m rows fall into panels: `whole` panels of kPanel lanes, then what is left in one or two narrower ones
// (kQuarter where at most kQuarter rows are left, else L where at most L are; with AVX-512 and `split_tail`, L and
// then kQuarter where at most L + kQuarter are; else kPanel). Panel p's data at p * kPanel lanes per element, its
// first row `first(p)`; `lanes` in all (m padded). The split is for float32 FMA tiles: smollm2's float32 layers on
// a 2-core AVX-512 EPYC, one process alternating two builds, 20 rows 39.4 -> 33.7 ms and 24 rows 38.9 -> 32.5 (a
// panel of 32 lanes 39.6, of 16 21.6); bfloat16 through vdpbf16ps gains nothing from it (20 rows 21.2 against 21.5
// ms), its half-vector tile costing a whole vector's time, and keeps the padded panel.
constexpr int64_t kQuarter = L >= 16 ? L / 2 : L;   // the narrowest panel: half a vector with AVX-512
struct PanelLayout {
  int64_t whole, tails = 0, tail[2] = {0, 0}, count, lanes;

  PanelLayout(int64_t m, bool split_tail) : whole(m / kPanel) {
    const int64_t rest = m % kPanel;
    if (rest > 0 && rest <= kQuarter) tail[tails++] = kQuarter;
    else if (rest > 0 && rest <= L) tail[tails++] = L;
    else if (rest > 0 && split_tail && kQuarter < L && rest <= L + kQuarter)
      tail[tails++] = L, tail[tails++] = kQuarter;
    else if (rest > 0) tail[tails++] = kPanel;
    count = whole + tails;
    lanes = whole * kPanel + tail[0] + tail[1];
  }
  int64_t width(int64_t p) const { return p < whole ? kPanel : tail[p - whole]; }
  int64_t first(int64_t p) const { return p <= whole ? p * kPanel : whole * kPanel + tail[0]; }
};

// x's rows [first, first + lanes) widened to float32 and stored k-major as panel p (element i of lane r at
// i * lanes + r), rows past m as zeros.
template <int64_t Kind>
void pack_panel(const Element<Kind>* x, int64_t x_stride, int64_t m, int64_t k, int64_t p, int64_t first,
                int64_t lanes, float* panels) {
  float* dst = panels + p * k * kPanel;
  const int64_t rows = m - first < lanes ? m - first : lanes;
  const Element<Kind>* src = x + first * x_stride;
  for (int64_t i = 0; i < k; ++i) {   // element by element: the panel is written in order, x read along its rows
    for (int64_t lane = 0; lane < rows; ++lane) dst[i * lanes + lane] = widen_one<Kind>(src[lane * x_stride + i]);
    for (int64_t lane = rows; lane < lanes; ++lane) dst[i * lanes + lane] = 0.0f;
  }
}

// sums[r * stride + lane] for the tile's 6 weight rows (w, row stride k) and one panel, every accumulator named
// so that the compiler keeps all twelve in registers. Every other step it also prefetches one cache line of
// [ahead, ahead + ahead_bytes) into L2: the next work item's weights, read while this one computes.
inline void gemm_tile(const float* panel, const float* w, int64_t k, float* sums, int64_t stride, const char* ahead,
                      int64_t ahead_bytes) {
  FloatVector c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {};
  FloatVector c30 = {}, c31 = {}, c40 = {}, c41 = {}, c50 = {}, c51 = {};
  const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k, *w4 = w + 4 * k, *w5 = w + 5 * k;
  for (int64_t i = 0; i < k; ++i) {
    if ((i & 1) == 0 && (i >> 1) * 64 < ahead_bytes) __builtin_prefetch(ahead + (i >> 1) * 64, 0, 2);
    const FloatVector x0 = cpu_kernels::load<float>(panel + i * kPanel);
    const FloatVector x1 = cpu_kernels::load<float>(panel + i * kPanel + L);
    FloatVector b = broadcast(w0 + i);
    c00 += b * x0, c01 += b * x1;
    b = broadcast(w1 + i), c10 += b * x0, c11 += b * x1;
    b = broadcast(w2 + i), c20 += b * x0, c21 += b * x1;
    b = broadcast(w3 + i), c30 += b * x0, c31 += b * x1;
    b = broadcast(w4 + i), c40 += b * x0, c41 += b * x1;
    b = broadcast(w5 + i), c50 += b * x0, c51 += b * x1;
  }
  const FloatVector tile[kTileN][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int64_t r = 0; r < kTileN; ++r) {
    cpu_kernels::store<float>(sums + r * stride, tile[r][0]);
    cpu_kernels::store<float>(sums + r * stride + L, tile[r][1]);
  }
}

// gemm_tile for a panel of one vector (L lanes, element i at i * L): kTileN accumulators, each lane's sum the same
// FMA chain as gemm_tile's. Taller tiles were slower (one pointer per weight row: at 12 rows and more the compiler
// runs out of registers; smollm2's 1536 x 576 layer at 16 rows, L3-hot, on a 2-core AVX-512 EPYC: 142 us with 6
// rows, 151 with 8, 194 with 12; 275 us at 32 rows with gemm_tile). Every other step it prefetches one line of
// [ahead, ahead + ahead_bytes), as gemm_tile.
inline void gemm_tile_narrow(const float* panel, const float* w, int64_t k, float* sums, int64_t stride,
                             const char* ahead, int64_t ahead_bytes) {
  FloatVector c[kTileN] = {};
  for (int64_t i = 0; i < k; ++i) {
    if ((i & 1) == 0 && (i >> 1) * 64 < ahead_bytes) __builtin_prefetch(ahead + (i >> 1) * 64, 0, 2);
    const FloatVector x0 = cpu_kernels::load<float>(panel + i * L);
#pragma GCC unroll 6
    for (int64_t r = 0; r < kTileN; ++r) c[r] += broadcast(w + r * k + i) * x0;
  }
#pragma GCC unroll 6
  for (int64_t r = 0; r < kTileN; ++r) cpu_kernels::store<float>(sums + r * stride, c[r]);
}

// gemm_tile_narrow for a panel of half a vector (kQuarter lanes): the same FMA chain per lane in half the width.
typedef float QuarterVector __attribute__((vector_size(kQuarter * 4)));
inline void gemm_tile_quarter(const float* panel, const float* w, int64_t k, float* sums, int64_t stride,
                              const char* ahead, int64_t ahead_bytes) {
  QuarterVector c[kTileN] = {};
  for (int64_t i = 0; i < k; ++i) {
    if ((i & 1) == 0 && (i >> 1) * 64 < ahead_bytes) __builtin_prefetch(ahead + (i >> 1) * 64, 0, 2);
    QuarterVector x0;
    std::memcpy(&x0, panel + i * kQuarter, sizeof x0);
#pragma GCC unroll 6
    for (int64_t r = 0; r < kTileN; ++r) c[r] += w[r * k + i] * x0;
  }
#pragma GCC unroll 6
  for (int64_t r = 0; r < kTileN; ++r) std::memcpy(sums + r * stride, &c[r], sizeof c[r]);
}

// The blocked product for bfloat16 through AVX512_BF16. A panel holds kPanel rows of x in pairs of elements along
// k: pair q of lane r at q * 2 * kPanel + r * 2 (the layout vdpbf16ps reads), zeros past x's rows and past k. A
// tile's weights are read in place, one pair of a row broadcast to every lane per step: no widening, no copy.

inline int64_t bf16_pairs(int64_t k) { return (k + 1) / 2; }

inline void pack_panel_bf16(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, int64_t p, int64_t first,
                            int64_t lanes, uint16_t* panels) {
  uint16_t* dst = panels + p * bf16_pairs(k) * 2 * kPanel;
  const int64_t rows = m - first < lanes ? m - first : lanes;
  const uint16_t* src = x + first * x_stride;
  for (int64_t q = 0; q < bf16_pairs(k); ++q) {
    uint16_t* pair = dst + q * 2 * lanes;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const bool row = lane < rows;
      pair[2 * lane] = row ? src[lane * x_stride + 2 * q] : 0;
      pair[2 * lane + 1] = row && 2 * q + 1 < k ? src[lane * x_stride + 2 * q + 1] : 0;
    }
  }
}

#if defined(__AVX512BF16__)
inline __m512bh bf16_pair(const uint16_t* p) {   // elements p[0], p[1] in every lane
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// gemm_tile's sums for bfloat16: 6 weight rows (row stride k, read in place) by one panel of pairs.
inline void gemm_tile_bf16(const uint16_t* panel, const uint16_t* w, int64_t k, float* sums, int64_t stride,
                           const char* ahead, int64_t ahead_bytes) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const uint16_t *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k, *w4 = w + 4 * k, *w5 = w + 5 * k;
  const int64_t whole = k / 2;
  for (int64_t q = 0; q < whole; ++q) {
    if (q * 64 < ahead_bytes) __builtin_prefetch(ahead + q * 64, 0, 2);
    const __m512bh x0 = bf16_load(panel + q * 2 * kPanel);
    const __m512bh x1 = bf16_load(panel + q * 2 * kPanel + kBf16Lanes);
    __m512bh b = bf16_pair(w0 + 2 * q);
    c00 = _mm512_dpbf16_ps(c00, b, x0), c01 = _mm512_dpbf16_ps(c01, b, x1);
    b = bf16_pair(w1 + 2 * q), c10 = _mm512_dpbf16_ps(c10, b, x0), c11 = _mm512_dpbf16_ps(c11, b, x1);
    b = bf16_pair(w2 + 2 * q), c20 = _mm512_dpbf16_ps(c20, b, x0), c21 = _mm512_dpbf16_ps(c21, b, x1);
    b = bf16_pair(w3 + 2 * q), c30 = _mm512_dpbf16_ps(c30, b, x0), c31 = _mm512_dpbf16_ps(c31, b, x1);
    b = bf16_pair(w4 + 2 * q), c40 = _mm512_dpbf16_ps(c40, b, x0), c41 = _mm512_dpbf16_ps(c41, b, x1);
    b = bf16_pair(w5 + 2 * q), c50 = _mm512_dpbf16_ps(c50, b, x0), c51 = _mm512_dpbf16_ps(c51, b, x1);
  }
  if (k % 2 == 1) {   // the last element alone: its pair's second weight is zero (never the next row's first)
    const __m512bh x0 = bf16_load(panel + whole * 2 * kPanel);
    const __m512bh x1 = bf16_load(panel + whole * 2 * kPanel + kBf16Lanes);
    const uint16_t* rows[kTileN] = {w0, w1, w2, w3, w4, w5};
    __m512* tile[kTileN][2] = {{&c00, &c01}, {&c10, &c11}, {&c20, &c21}, {&c30, &c31}, {&c40, &c41}, {&c50, &c51}};
    for (int64_t r = 0; r < kTileN; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[r][k - 1]));
      *tile[r][0] = _mm512_dpbf16_ps(*tile[r][0], b, x0);
      *tile[r][1] = _mm512_dpbf16_ps(*tile[r][1], b, x1);
    }
  }
  const __m512 tile[kTileN][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int64_t r = 0; r < kTileN; ++r) {
    _mm512_storeu_ps(sums + r * stride, tile[r][0]);
    _mm512_storeu_ps(sums + r * stride + L, tile[r][1]);
  }
}

// gemm_tile_bf16 for a panel of one vector (pair q at q * 2 * L, 512-bit vdpbf16ps) or, Full false, of half a
// vector (8 lanes, 256-bit), kTileN weight rows as gemm_tile_narrow.
inline __m512 dp_bf16(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }
inline __m256 dp_bf16(__m256 acc, __m256bh a, __m256bh b) { return _mm256_dpbf16_ps(acc, a, b); }
inline void store_sums(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_sums(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

template <bool Full>
inline void gemm_tile_bf16_one(const uint16_t* panel, const uint16_t* w, int64_t k, float* sums, int64_t stride,
                               const char* ahead, int64_t ahead_bytes) {
  using Acc = std::conditional_t<Full, __m512, __m256>;
  using Pairs = std::conditional_t<Full, __m512bh, __m256bh>;
  constexpr int64_t lanes = Full ? L : kQuarter;
  auto load_x = [](const uint16_t* p) -> Pairs {
    if constexpr (Full) return bf16_load(p);
    else return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  auto pair = [](uint32_t bits) -> Pairs {   // a pair of a weight row's elements in every lane
    if constexpr (Full) return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
    else return (__m256bh)_mm256_set1_epi32(static_cast<int>(bits));
  };
  Acc c[kTileN];
#pragma GCC unroll 6
  for (int64_t r = 0; r < kTileN; ++r) c[r] = Acc{};
  const int64_t whole = k / 2;
  for (int64_t q = 0; q < whole; ++q) {
    if (q * 64 < ahead_bytes) __builtin_prefetch(ahead + q * 64, 0, 2);
    const Pairs x0 = load_x(panel + q * 2 * lanes);
#pragma GCC unroll 6
    for (int64_t r = 0; r < kTileN; ++r) {
      uint32_t bits;
      std::memcpy(&bits, w + r * k + 2 * q, 4);
      c[r] = dp_bf16(c[r], pair(bits), x0);
    }
  }
  if (k % 2 == 1) {   // the last element alone, as in gemm_tile_bf16
    const Pairs x0 = load_x(panel + whole * 2 * lanes);
    for (int64_t r = 0; r < kTileN; ++r) c[r] = dp_bf16(c[r], pair(w[r * k + k - 1]), x0);
  }
#pragma GCC unroll 6
  for (int64_t r = 0; r < kTileN; ++r) store_sums(sums + r * stride, c[r]);
}
#else
inline void gemm_tile_bf16(const uint16_t*, const uint16_t*, int64_t, float*, int64_t, const char*, int64_t) {}
template <bool Full>
inline void gemm_tile_bf16_one(const uint16_t*, const uint16_t*, int64_t, float*, int64_t, const char*, int64_t) {}
#endif

// The packed panels' element: bfloat16 pairs for gemm_tile_bf16, float32 otherwise.
template <int64_t Kind>
using Packed = std::conditional_t<Kind == kBFloat16 && kNativeBFloat16, uint16_t, float>;

// One register tile of kTileN weight rows (w, row stride k) over a panel `width` lanes wide (kPanel, L or kQuarter).
template <int64_t Kind>
inline void panel_tile(int64_t width, const Packed<Kind>* panel, const Packed<Kind>* w, int64_t k, float* sums,
                       int64_t stride, const char* ahead, int64_t ahead_bytes) {
  if constexpr (Kind == kBFloat16 && kNativeBFloat16) {
    if (width == kPanel) gemm_tile_bf16(panel, w, k, sums, stride, ahead, ahead_bytes);
    else if (width == L) gemm_tile_bf16_one<true>(panel, w, k, sums, stride, ahead, ahead_bytes);
    else gemm_tile_bf16_one<false>(panel, w, k, sums, stride, ahead, ahead_bytes);
  } else {
    if (width == kPanel) gemm_tile(panel, w, k, sums, stride, ahead, ahead_bytes);
    else if (width == L) gemm_tile_narrow(panel, w, k, sums, stride, ahead, ahead_bytes);
    else gemm_tile_quarter(panel, w, k, sums, stride, ahead, ahead_bytes);
  }
}

// One work item: weight rows [n0, n1) of a segment widened to float32 (zero rows up to a whole tile; float32
// weights in whole tiles, and bfloat16 ones for gemm_tile_bf16, are read in place), their sums over every panel,
// then bias and rounding into the output.

template <int64_t Kind>
void gemm_rows(const Segment<Kind>& seg, int64_t k, const Packed<Kind>* panels, int64_t m, int64_t n0, int64_t n1) {
  thread_local std::vector<float> wide, sums;
  constexpr bool kHalf = Kind == kBFloat16 && kNativeBFloat16;   // bfloat16 through gemm_tile_bf16
  const int64_t rows = n1 - n0, tiled = (rows + kTileN - 1) / kTileN * kTileN;
  const PanelLayout layout(m, !kHalf);
  const int64_t m_pad = layout.lanes;
  const Element<Kind>* src = seg.weight + n0 * k;
  const std::conditional_t<kHalf, Element<Kind>, float>* w;
  if constexpr (Kind == kFloat32 || kHalf) {
    w = src;
  }
  if constexpr (kHalf) {   // a last tile of fewer rows: copied, zero rows after
    thread_local std::vector<uint16_t> padded;
    if (rows != tiled) {
      padded.assign(static_cast<size_t>(tiled * k), 0);
      std::memcpy(padded.data(), src, static_cast<size_t>(rows * k) * 2);
      w = padded.data();
    }
  } else if (Kind != kFloat32 || rows != tiled) {
    wide.resize(static_cast<size_t>(tiled * k));
    const int64_t total = rows * k, vec_end = total - total % L;
    for (int64_t i = 0; i < vec_end; i += L) cpu_kernels::store<float>(wide.data() + i, widen<Kind>(src + i));
    for (int64_t i = vec_end; i < total; ++i) wide[i] = widen_one<Kind>(src[i]);
    std::memset(wide.data() + total, 0, static_cast<size_t>((tiled - rows) * k) * sizeof(float));
    w = wide.data();
  }
  // The first panel's tiles prefetch the rows after these (the next work item of this thread, mostly), in shares.
  const int64_t next_rows = seg.n - n1 < kGemmTask ? seg.n - n1 : kGemmTask;
  const char* ahead = reinterpret_cast<const char*>(seg.weight + n1 * k);
  const int64_t share = (next_rows * k * static_cast<int64_t>(sizeof(Element<Kind>)) + tiled / kTileN - 1) /
                        (tiled / kTileN);
  sums.resize(static_cast<size_t>(tiled * m_pad));
  for (int64_t p = 0; p < layout.count; ++p) {
    const Packed<Kind>* panel = panels + p * (kHalf ? bf16_pairs(k) * 2 : k) * kPanel;
    float* const panel_sums = sums.data() + layout.first(p);
    const int64_t ahead_bytes = p == 0 ? share : 0;
    const int64_t width = layout.width(p);
    for (int64_t j = 0; j < tiled; j += kTileN)
      panel_tile<Kind>(width, panel, w + j * k, k, panel_sums + j * m_pad, m_pad, ahead + (j / kTileN) * share,
                       ahead_bytes);
  }
  float bias[kGemmTask];
  for (int64_t j = 0; j < rows; ++j) bias[j] = seg.bias != nullptr ? widen_one<Kind>(seg.bias[n0 + j]) : 0.0f;
  for (int64_t r = 0; r < m; ++r) {   // row by row: each output row's share is written in order
    Element<Kind>* out = seg.out + r * seg.n + n0;
    for (int64_t j = 0; j < rows; ++j) out[j] = narrow<Kind>(sums[j * m_pad + r] + bias[j]);
  }
}

// out_s = x W_s^T (+ bias_s) for every segment at m >= gemm_min_rows<Kind>(): x packed by both threads, then the
// segments' kGemmTask-row work items shared among them, in one parallel region.
template <int64_t Kind>
void gemm(const Element<Kind>* x, int64_t x_stride, const Segment<Kind>* segments, int64_t count, int64_t m,
          int64_t k, int64_t num_threads) {
  constexpr bool kHalf = Kind == kBFloat16 && kNativeBFloat16;
  thread_local std::vector<Packed<Kind>> packed;
  thread_local std::vector<int64_t> first_task;
  const PanelLayout layout(m, !kHalf);
  const int64_t panels = layout.count;
  packed.resize(static_cast<size_t>(panels * kPanel * (kHalf ? 2 * bf16_pairs(k) : k)));
  first_task.resize(static_cast<size_t>(count + 1));
  int64_t tasks = 0;
  for (int64_t s = 0; s < count; ++s) {
    first_task[s] = tasks;
    tasks += (segments[s].n + kGemmTask - 1) / kGemmTask;
  }
  first_task[count] = tasks;
  Packed<Kind>* const panel_data = packed.data();
  const int64_t* const firsts = first_task.data();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      if constexpr (kHalf) pack_panel_bf16(x, x_stride, m, k, p, layout.first(p), layout.width(p), panel_data);
      else pack_panel<Kind>(x, x_stride, m, k, p, layout.first(p), layout.width(p), panel_data);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      int64_t s = 0;
      while (firsts[s + 1] <= t) ++s;
      const int64_t n0 = (t - firsts[s]) * kGemmTask;
      gemm_rows<Kind>(segments[s], k, panel_data, m, n0, n0 + kGemmTask < segments[s].n ? n0 + kGemmTask : segments[s].n);
    }
  }
}


// out_s = x W_s^T (+ bias_s) for every segment s, in one parallel region: the weights' row blocks are shared among
// the threads as one list, so the layers that read the same x (a layer's q, k and v; gate and up) cost one fork
// and join instead of one each, and each thread's share is balanced over their total rows. Each output row is
// the same dot product as for a segment alone.
template <int64_t Kind>
void linear(const Element<Kind>* x, int64_t x_stride, const Segment<Kind>* segments, int64_t count, int64_t m,
            int64_t k, int64_t num_threads) {
  if (m >= gemm_min_rows<Kind>()) {
    gemm<Kind>(x, x_stride, segments, count, m, k, num_threads);
    return;
  }
  // x stays bfloat16 for dot_block_bf16 from two rows on, and at one row over rows of up to kRowByRowMaxKBf16
  // elements (dot_row_bf16: smollm2's layers at 1 row on a 2-core Xeon, weights in huge pages, 11.3-11.7 -> 10.4-10.7
  // ms; its 1536-wide rows on a 2-core AVX-512 EPYC, above). Longer rows at one row keep float32 FMAs: vdpbf16ps
  // tiles were slower there (on the AVX-512 EPYC, FMAs 11.6 ms against 12.9 over smollm2's layers).
  const bool half_x = Kind == kBFloat16 && kNativeBFloat16 && (m > 1 || k <= kRowByRowMaxKBf16);
  thread_local std::vector<float> wide, sums;   // x in float32, and the float32 results before rounding
  thread_local std::vector<uint16_t> half;      // or x in bfloat16, rows contiguous
  thread_local std::vector<int64_t> first_task, sum_offset;   // per segment: its first work item, its sums
  if (half_x) half.resize(static_cast<size_t>(m * k));
  else wide.resize(static_cast<size_t>(m * k));
  first_task.resize(static_cast<size_t>(count + 1));
  sum_offset.resize(static_cast<size_t>(count));
  int64_t tasks = 0, total = 0;
  for (int64_t s = 0; s < count; ++s) {
    first_task[s] = tasks;
    sum_offset[s] = total;
    tasks += (segments[s].n + kRowsPerTask - 1) / kRowsPerTask;
    total += m * segments[s].n;
  }
  first_task[count] = tasks;
  sums.resize(static_cast<size_t>(total));
  if (half_x) {
    for (int64_t r = 0; r < m; ++r) std::memcpy(half.data() + r * k, x + r * x_stride, static_cast<size_t>(k) * 2);
  } else {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) wide[r * k + i] = widen_one<Kind>(x[r * x_stride + i]);
  }
  float* const sum_data = sums.data();
  const float* const x_data = wide.data();
  const uint16_t* const half_data = half.data();
  const int64_t* const firsts = first_task.data();
  const int64_t* const offsets = sum_offset.data();
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    int64_t s = 0;
    while (firsts[s + 1] <= t) ++s;
    const Segment<Kind>& seg = segments[s];
    const int64_t n = seg.n;
    const int64_t n0 = (t - firsts[s]) * kRowsPerTask, n1 = n0 + kRowsPerTask < n ? n0 + kRowsPerTask : n;
    float* const seg_sums = sum_data + offsets[s];
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t rows = m - r < kMaxRows ? m - r : kMaxRows;
      if constexpr (Kind == kBFloat16) {
        if (half_x) {
          dot_block_bf16(rows, seg.weight, k, half_data + r * k, n0, n1, seg_sums + r * n, n);
          continue;
        }
      }
      dot_block<Kind>(rows, seg.weight, k, x_data + r * k, n0, n1, seg_sums + r * n, n);
    }
    // The task's outputs, by the thread that summed them: a pass after the region ran on one thread while the
    // other waited (about 200 thousand outputs per smollm2 batch-1 step; the step 19.5 -> 18.9 ms, noisy).
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = n0; j < n1; ++j) {
        float v = seg_sums[r * n + j];
        if (seg.bias != nullptr) v += widen_one<Kind>(seg.bias[j]);
        seg.out[r * n + j] = narrow<Kind>(v);
      }
  }
}

template <int64_t Kind>
int linear_kind(const void* x, int64_t x_stride, const void* const* weights, const void* const* biases,
                void* const* outs, const int64_t* ns, int64_t count, int64_t m, int64_t k, int64_t num_threads) {
  thread_local std::vector<Segment<Kind>> segments;
  segments.resize(static_cast<size_t>(count));
  for (int64_t s = 0; s < count; ++s) {
    if (ns[s] < 0) return -1;
    segments[s] = {static_cast<const Element<Kind>*>(weights[s]), static_cast<const Element<Kind>*>(biases[s]),
                   static_cast<Element<Kind>*>(outs[s]), ns[s]};
  }
  linear<Kind>(static_cast<const Element<Kind>*>(x), x_stride, segments.data(), count, m, k, num_threads);
  return 0;
}

}  // namespace

extern "C" {

// Weights of the one-to-few-row products prefetched non-temporally (on: nonzero) or into every cache level.
void linear_rows_set_streaming(int64_t on) { stream_weights.store(on != 0, std::memory_order_relaxed); }

int64_t linear_rows_streaming() { return stream_weights.load(std::memory_order_relaxed) ? 1 : 0; }

// outs[s][m, ns[s]] = x[m, k] W_s[ns[s], k]^T (+ biases[s]) for `count` weights over one x, all of one kind (0:
// bfloat16, 1: float16, 2: float32); x has a row stride, the weights, biases (null: none) and outputs are
// contiguous. Returns 0, or -1 for an unknown kind or a bad size.
int linear_rows_multi(const void* x, int64_t x_stride, const void* const* weights, const void* const* biases,
                      void* const* outs, const int64_t* ns, int64_t count, int64_t m, int64_t k, int64_t kind,
                      int64_t num_threads) {
  if (m < 0 || k < 0 || count < 1 || x_stride < k) return -1;
  if (kind == kBFloat16) return linear_kind<kBFloat16>(x, x_stride, weights, biases, outs, ns, count, m, k, num_threads);
  if (kind == kFloat16) return linear_kind<kFloat16>(x, x_stride, weights, biases, outs, ns, count, m, k, num_threads);
  if (kind == kFloat32) return linear_kind<kFloat32>(x, x_stride, weights, biases, outs, ns, count, m, k, num_threads);
  return -1;
}

}
