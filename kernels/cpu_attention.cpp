// Paged attention on the CPU that reads the paged KV cache in place (no gathered copy, no padding).
//
// Built at first use by kernels/cpu_build.py (plain C++17 and OpenMP, no PyTorch headers) and called
// through ctypes (kernels/cpu.py). One work item is a query tile (up to kQueryTile new tokens of one
// sequence) with all its heads, so every K/V row the tile sees is read from the cache once, in the cache's
// own order (a block's slots and heads are contiguous). For each tile of keys the item computes the scores
// of all its rows (dot products for decode, a transposed-K micro-kernel for prefill), then updates an online softmax
// (running max m, sum l, unnormalised accumulator acc), as flash attention does. Scores, softmax and
// the accumulator are in Acc (float, or double for float64 queries); cache rows of another type
// (float16, bfloat16, fp8) are widened in registers where decode rows read them, and converted row by row into
// a small buffer for prefill tiles and float64 queries. The per-tensor fp8 scales are
// folded into the query (k_scale) and the output (v_scale). The semantics (causal over the new
// tokens, sliding window, soft-cap, sinks) are those of kernels/variant.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vector.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#else
inline int omp_get_thread_num() { return 0; }
inline int omp_get_num_threads() { return 1; }
#endif

namespace {

using namespace cpu_kernels;

enum CacheType : int64_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kE4M3 = 4, kE5M2 = 5 };

constexpr int64_t entry_bytes(int64_t type) {   // bytes per cache entry
  return type == kF64 ? 8 : type == kF32 ? 4 : (type == kF16 || type == kBF16) ? 2 : 1;
}

constexpr int64_t kKeyTile = 32;     // keys per softmax update
constexpr int64_t kQueryTile = 16;   // query tokens per work item (prefill chunks)

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// IEEE half -> float, subnormals included: shift the exponent and mantissa into float position, then
// rebias with one exact multiplication (2^(127-15)); infinities and NaNs keep an all-ones exponent.
inline float half_to_float(uint16_t h) {
  uint32_t magnitude = h & 0x7fffu;
  uint32_t bits = float_to_bits(bits_to_float(magnitude << 13) * 0x1.0p112f);
  if (magnitude >= 0x7c00u) bits = (magnitude << 13) | 0x7f800000u;
  return bits_to_float(bits | (uint32_t(h & 0x8000u) << 16));
}

inline float bfloat16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// fp8 decoding tables (OCP e4m3fn: bias 7, no infinities, 0x7f is NaN; e5m2: bias 15, IEEE-like).
struct Fp8Tables {
  float e4m3[256];
  float e5m2[256];
  Fp8Tables() {
    for (uint32_t x = 0; x < 256; ++x) {
      uint32_t magnitude = x & 0x7fu, sign = (x & 0x80u) << 24;
      float v = bits_to_float(magnitude << 20) * 0x1.0p120f;
      e4m3[x] = magnitude == 0x7fu ? std::numeric_limits<float>::quiet_NaN() : bits_to_float(float_to_bits(v) | sign);
      uint32_t bits = float_to_bits(bits_to_float(magnitude << 21) * 0x1.0p112f);
      if (magnitude >= 0x7cu) bits = (magnitude << 21) | 0x7f800000u;
      e5m2[x] = bits_to_float(bits | sign);
    }
  }
};

const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}

// One vector of 16-bit or fp8 cache entries as floats, by bit arithmetic (no tables, no scalar loop). NaN and
// infinities of fp8 never reach attention (written entries are saturated; unwritten slots are never read).
template <int64_t Type>
inline FloatVector decode_vector(const void* entries) {
  constexpr int64_t L = Vector<float>::lanes;
#if defined(__AVX512F__)
  if constexpr (Type == kBF16 && L == 16) {   // one widening load and a shift (GCC's generic conversion took two
    const __m512i wide = _mm512_slli_epi32(   // halves and an insert when tuned for 256-bit vectors)
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(entries))), 16);
    FloatVector result;
    std::memcpy(&result, &wide, sizeof result);
    return result;
  }
#endif
  IntVector x;
  if constexpr (Type == kF16 || Type == kBF16) {
    typedef uint16_t Halves __attribute__((vector_size(2 * L)));
    Halves raw;
    std::memcpy(&raw, entries, sizeof raw);
    x = __builtin_convertvector(raw, IntVector);
  } else {
    typedef uint8_t Bytes __attribute__((vector_size(L)));
    Bytes raw;
    std::memcpy(&raw, entries, sizeof raw);
    x = __builtin_convertvector(raw, IntVector);
  }
  IntVector bits;
  if constexpr (Type == kBF16) {
    bits = x << 16;
  } else if constexpr (Type == kF16) {   // rebias by multiplying (exact, subnormals included); then inf/NaN
    const IntVector magnitude = x & 0x7fff;
    IntVector shifted = magnitude << 13;
    FloatVector value;
    std::memcpy(&value, &shifted, sizeof value);
    value *= 0x1.0p112f;
    std::memcpy(&bits, &value, sizeof bits);
    bits = magnitude >= 0x7c00 ? (shifted | 0x7f800000) : bits;
    bits |= (x & 0x8000) << 16;
  } else {
    const IntVector magnitude = x & 0x7f;
    constexpr int mantissa = Type == kE4M3 ? 3 : 2, bias = Type == kE4M3 ? 120 : 112;
    constexpr int smallest_normal = 1 << mantissa;
    constexpr float subnormal_step = Type == kE4M3 ? 0x1p-9f : 0x1p-16f;
    const IntVector normal = (((magnitude >> mantissa) + bias) << 23) | ((magnitude & (smallest_normal - 1)) << (23 - mantissa));
    const FloatVector small = __builtin_convertvector(magnitude, FloatVector) * subnormal_step;
    IntVector small_bits;
    std::memcpy(&small_bits, &small, sizeof small_bits);
    bits = (magnitude >= smallest_normal ? normal : small_bits) | ((x & 0x80) << 24);
  }
  FloatVector result;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

// One cache row as Acc: a pointer into the cache when it already holds Acc, else converted into `buffer`.
template <typename Acc, int64_t Type>
inline const Acc* cache_row(const void* base, int64_t offset, int64_t head_size, Acc* buffer) {
  if constexpr (Type == kF32) {
    const float* row = static_cast<const float*>(base) + offset;
    if constexpr (std::is_same_v<Acc, float>) return row;
    for (int64_t d = 0; d < head_size; ++d) buffer[d] = Acc(row[d]);
  } else if constexpr (Type == kF64) {
    const double* row = static_cast<const double*>(base) + offset;
    if constexpr (std::is_same_v<Acc, double>) return row;
    for (int64_t d = 0; d < head_size; ++d) buffer[d] = Acc(row[d]);
  } else {
    constexpr int64_t bytes = entry_bytes(Type);
    const uint8_t* row = static_cast<const uint8_t*>(base) + offset * bytes;
    int64_t d = 0;
    if constexpr (std::is_same_v<Acc, float>) {
      constexpr int64_t L = Vector<float>::lanes;
      for (; d + L <= head_size; d += L) store(buffer + d, decode_vector<Type>(row + d * bytes));
    }
    for (; d < head_size; ++d) {
      if constexpr (Type == kF16) {
        buffer[d] = Acc(half_to_float(reinterpret_cast<const uint16_t*>(row)[d]));
      } else if constexpr (Type == kBF16) {
        buffer[d] = Acc(bfloat16_to_float(reinterpret_cast<const uint16_t*>(row)[d]));
      } else {
        buffer[d] = Acc((Type == kE4M3 ? fp8_tables().e4m3 : fp8_tables().e5m2)[row[d]]);
      }
    }
  }
  return buffer;
}

template <typename Acc>
struct Params {
  const Acc* query;          // [num_tokens, num_heads, head_size], contiguous
  Acc* out;                  // same layout
  const void* key_cache;     // [num_blocks, block_size, num_kv_heads, head_size], last dim contiguous
  const void* value_cache;
  int64_t k_strides[3];      // block, slot, head (elements)
  int64_t v_strides[3];
  const int64_t* block_tables;  // [num_seqs, table_width]
  int64_t table_width;
  const int64_t* context_lens;  // [num_seqs]
  const int64_t* query_start;   // [num_seqs + 1]
  int64_t num_heads, num_kv_heads, head_size, block_size;
  Acc scale;                 // softmax scale times k_scale
  Acc v_scale;
  int64_t sliding_window;    // 0: none
  Acc softcap;               // 0: none
  const Acc* sinks;          // [num_heads] or null
};

struct WorkItem {
  int64_t seq, row_begin, row_end;  // query rows [row_begin, row_end) of sequence seq
  int64_t kv_begin, kv_end;         // its KV heads [kv_begin, kv_end): all, unless items are fewer than threads
  int64_t g_begin, g_end;           // the query heads [g_begin, g_end) of each KV head's group (all but in a split)
};

constexpr int64_t kRowBlock = 4;  // query rows sharing each loaded K/V vector in the prefill micro-kernels

// The sum of a float vector's lanes as a tree of halves (16 -> 8 -> 4 -> 2 -> 1 with AVX-512): a few shuffles and
// additions instead of a serial chain through every lane, which was half the time of a 16-sequence decode step's
// scores. Every float score (dot, few_row_scores) and softmax sum adds in this order, so the in-place and copying
// paths agree bit for bit. float64 (the exact-comparison dtype) keeps the lanes in order.
template <typename Acc>
inline Acc lane_sum(typename Vector<Acc>::type v) {
  return horizontal_sum<Acc>(v);
}

template <>
inline float lane_sum<float>(FloatVector v) {
  typedef float Quad __attribute__((vector_size(16)));
  typedef float Octet __attribute__((vector_size(32)));
  Octet eight;
#if defined(__AVX512F__)   // 16 floats (cpu_vector.h): halves first
  Octet low8, high8;
  std::memcpy(&low8, &v, sizeof low8);
  std::memcpy(&high8, reinterpret_cast<const char*>(&v) + sizeof low8, sizeof high8);
  eight = low8 + high8;
#else   // 8 floats
  std::memcpy(&eight, &v, sizeof eight);
#endif
  Quad low, high;
  std::memcpy(&low, &eight, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&eight) + sizeof low, sizeof high);
  const Quad four = low + high;
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// lane_sum of L vectors of L floats at once (L = 16 with AVX-512, 8 with AVX2), out[i] = lane_sum(v[i]) bit for
// bit: the same tree of halves taken across the vectors by shuffles (L - 1 pairs of shuffles and additions instead
// of L trees). Where the compiler has __builtin_shufflevector (GCC 12+, Clang); elsewhere one tree per vector.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define PAGED_BACKEND_LANE_SUMS 1
#endif
#endif
#ifdef PAGED_BACKEND_LANE_SUMS
constexpr bool kLaneSums = true;
inline void lane_sums(const FloatVector* v, float* out) {
  typedef FloatVector V;
  V u[4], w[2];
#if defined(__AVX512F__)   // the vector width is chosen by the preprocessor (cpu_vector.h): 16 floats here
  {
    V t[8];
    for (int i = 0; i < 8; ++i)   // lanes 0-7: v[2i]'s halves added; 8-15: v[2i+1]'s
      t[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; ++j)   // four lanes per vector 4j..4j+3: their quarters added
      u[j] = __builtin_shufflevector(t[2 * j], t[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(t[2 * j], t[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; ++m)   // lanes 2i, 2i+1: (q0 + q2), (q1 + q3) of vector 8m + i
      w[m] = __builtin_shufflevector(u[2 * m], u[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(u[2 * m], u[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    store(out, __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                   __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
  }
#else   // 8 floats
  {
    for (int j = 0; j < 4; ++j)   // lanes 0-3: v[2j]'s halves added; 4-7: v[2j+1]'s
      u[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int m = 0; m < 2; ++m)   // lanes 2i, 2i+1: (q0 + q2), (q1 + q3) of vector 4m + i
      w[m] = __builtin_shufflevector(u[2 * m], u[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
             __builtin_shufflevector(u[2 * m], u[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    store(out, __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                   __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15));
  }
#endif
}
#else
constexpr bool kLaneSums = false;
inline void lane_sums(const FloatVector*, float*) {}
#endif

// Dot product over two vector accumulators, then a scalar tail.
template <typename Acc>
inline Acc dot(const Acc* a, const Acc* b, int64_t n) {
  constexpr int64_t L = Vector<Acc>::lanes;
  typename Vector<Acc>::type s0 = {}, s1 = {};
  int64_t d = 0;
  for (; d + 2 * L <= n; d += 2 * L) {
    s0 += load(a + d) * load(b + d);
    s1 += load(a + d + L) * load(b + d + L);
  }
  for (; d + L <= n; d += L) s0 += load(a + d) * load(b + d);
  Acc sum = lane_sum<Acc>(s0 + s1);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// Rows already in Acc (converted copies, or the cache itself when it holds Acc), read through the accessor that
// `accumulate` shares with rows widened where they are (RawRows, below).
template <typename Acc>
struct CopiedRows {
  const Acc* const* rows;
  typename Vector<Acc>::type vector(int64_t k, int64_t d) const { return load(rows[k] + d); }
  Acc scalar(int64_t k, int64_t d) const { return rows[k][d]; }
};

// acc[i][0:n] += sum_k weights[i][k] * rows[k][0:n] for R rows i (row strides n and kKeyTile) over a
// tile of keys: each loaded value vector serves R rows, and J vectors of each row are accumulated at once so
// that R * J independent chains of multiply-adds hide their latency; the accumulators stay in registers.
template <typename Acc, int64_t R, typename Rows>
inline void accumulate(Acc* acc, const Acc* weights, const Rows& rows, int64_t num_keys, int64_t n) {
  constexpr int64_t L = Vector<Acc>::lanes;
  constexpr int64_t J = R >= 3 ? 2 : 4;
  typedef typename Vector<Acc>::type V;
  int64_t d = 0;
  for (; d + J * L <= n; d += J * L) {
    V c[R][J];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < J; ++j) c[i][j] = load(acc + i * n + d + j * L);
    for (int64_t k = 0; k < num_keys; ++k) {
      V v[J];
      for (int64_t j = 0; j < J; ++j) v[j] = rows.vector(k, d + j * L);
      for (int64_t i = 0; i < R; ++i) {
        const Acc w = weights[i * kKeyTile + k];
        for (int64_t j = 0; j < J; ++j) c[i][j] += w * v[j];
      }
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < J; ++j) store(acc + i * n + d + j * L, c[i][j]);
  }
  for (; d + L <= n; d += L) {
    V c[R];
    for (int64_t i = 0; i < R; ++i) c[i] = load(acc + i * n + d);
    for (int64_t k = 0; k < num_keys; ++k) {
      const V v = rows.vector(k, d);
      for (int64_t i = 0; i < R; ++i) c[i] += weights[i * kKeyTile + k] * v;
    }
    for (int64_t i = 0; i < R; ++i) store(acc + i * n + d, c[i]);
  }
  for (; d < n; ++d)
    for (int64_t k = 0; k < num_keys; ++k)
      for (int64_t i = 0; i < R; ++i) acc[i * n + d] += weights[i * kKeyTile + k] * rows.scalar(k, d);
}

// accumulate over `count` rows, in blocks of kRowBlock and one call for the rest (1-3 rows: a decode group).
template <typename Acc, typename Rows>
inline void accumulate_rows(Acc* acc, const Acc* weights, const Rows& rows, int64_t num_keys, int64_t n,
                            int64_t count) {
  int64_t i = 0;
  for (; i + kRowBlock <= count; i += kRowBlock)
    accumulate<Acc, kRowBlock>(acc + i * n, weights + i * kKeyTile, rows, num_keys, n);
  switch (count - i) {
    case 3: accumulate<Acc, 3>(acc + i * n, weights + i * kKeyTile, rows, num_keys, n); break;
    case 2: accumulate<Acc, 2>(acc + i * n, weights + i * kKeyTile, rows, num_keys, n); break;
    case 1: accumulate<Acc, 1>(acc + i * n, weights + i * kKeyTile, rows, num_keys, n); break;
    default: break;
  }
}

// Scores of `rows` query rows (row stride d) against the keys of one tile, written to s (stride kKeyTile).
// Few rows (decode): one dot product per pair. Many rows (prefill): the tile's keys are transposed once,
// then each row is a broadcast-multiply-add over the head dimension (no horizontal sums).
template <typename Acc>
void tile_scores(const Acc* q, int64_t rows, const Acc* const* keys, int64_t n, int64_t d_size, Acc* s,
                 Acc* transposed) {
  constexpr int64_t L = Vector<Acc>::lanes;
  if (rows < 4 || n < kKeyTile) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < n; ++k) s[r * kKeyTile + k] = dot(q + r * d_size, keys[k], d_size);
    return;
  }
  for (int64_t k = 0; k < kKeyTile; ++k)
    for (int64_t d = 0; d < d_size; ++d) transposed[d * kKeyTile + k] = keys[k][d];
  static_assert(kKeyTile % L == 0, "the key tile is a whole number of vectors");
  constexpr int64_t J = kKeyTile / L;
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    typename Vector<Acc>::type c[kRowBlock][J] = {};
    for (int64_t d = 0; d < d_size; ++d) {
      const Acc* kt = transposed + d * kKeyTile;
      for (int64_t j = 0; j < J; ++j) {
        const typename Vector<Acc>::type kv = load(kt + j * L);
        for (int64_t i = 0; i < kRowBlock; ++i) c[i][j] += q[(r + i) * d_size + d] * kv;
      }
    }
    for (int64_t i = 0; i < kRowBlock; ++i)
      for (int64_t j = 0; j < J; ++j) store(s + (r + i) * kKeyTile + j * L, c[i][j]);
  }
  for (; r < rows; ++r) {
    typename Vector<Acc>::type c[J] = {};
    for (int64_t d = 0; d < d_size; ++d)
      for (int64_t j = 0; j < J; ++j) c[j] += q[r * d_size + d] * load(transposed + d * kKeyTile + j * L);
    for (int64_t j = 0; j < J; ++j) store(s + r * kKeyTile + j * L, c[j]);
  }
}

// ---- Decode rows: the cache read in place ------------------------------------------------------------------
//
// A decode token's work item has few query rows per KV head (its group: 1-3 here), and converting every cache
// row into a float copy, then reading the copy back, cost more than the arithmetic on it. With float32 queries
// the rows are widened in registers as they are used instead; each score and each value sum keeps the order of
// additions of the copying path (`dot`, `accumulate`), so the results are the same bit for bit.

// Cache rows of one tile (pointers to their first entries), widened on use.
template <int64_t Type>
struct RawRows {
  const char* const* rows;

  FloatVector vector(int64_t k, int64_t d) const {   // entries [d, d + lanes) of row k
    if constexpr (Type == kF32) return load(reinterpret_cast<const float*>(rows[k]) + d);
    else return decode_vector<Type>(rows[k] + d * entry_bytes(Type));
  }
  float scalar(int64_t k, int64_t d) const {   // for accumulate's tail loop, which whole vectors never reach
    constexpr int64_t lanes = Vector<float>::lanes;
    return vector(k, d - d % lanes)[d % lanes];
  }
};

// Scores of R query rows (row stride d_size, a whole number of vectors) against n keys, s[r * kKeyTile + k]:
// each key row is widened once for all R rows; per pair the additions are dot()'s (two accumulators over
// alternate vectors, then lane_sum of their sum). The accumulators are named (GCC kept arrays in memory).
template <int64_t Type, int64_t R>
inline void few_row_scores(const float* q, int64_t d_size, const RawRows<Type>& keys, int64_t n, float* s) {
  constexpr int64_t L = Vector<float>::lanes;
  static_assert(R >= 1 && R <= 3, "one to three rows");
  const float* q0 = q;
  const float* q1 = q + (R > 1 ? d_size : 0);
  const float* q2 = q + (R > 2 ? 2 * d_size : 0);
  FloatVector sums[R][kKeyTile];   // per pair, the vector whose lanes dot() adds
  for (int64_t k = 0; k < n; ++k) {
    FloatVector a0 = {}, a1 = {}, a2 = {}, b0 = {}, b1 = {}, b2 = {};
    int64_t d = 0;
    for (; d + 2 * L <= d_size; d += 2 * L) {
      const FloatVector k0 = keys.vector(k, d), k1 = keys.vector(k, d + L);
      a0 += load(q0 + d) * k0;
      b0 += load(q0 + d + L) * k1;
      if constexpr (R > 1) {
        a1 += load(q1 + d) * k0;
        b1 += load(q1 + d + L) * k1;
      }
      if constexpr (R > 2) {
        a2 += load(q2 + d) * k0;
        b2 += load(q2 + d + L) * k1;
      }
    }
    if (d < d_size) {
      const FloatVector k0 = keys.vector(k, d);
      a0 += load(q0 + d) * k0;
      if constexpr (R > 1) a1 += load(q1 + d) * k0;
      if constexpr (R > 2) a2 += load(q2 + d) * k0;
    }
    sums[0][k] = a0 + b0;
    if constexpr (R > 1) sums[1][k] = a1 + b1;
    if constexpr (R > 2) sums[2][k] = a2 + b2;
  }
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * kKeyTile;
    int64_t k = 0;
    if constexpr (kLaneSums)
      for (constexpr int64_t L = Vector<float>::lanes; k + L <= n; k += L) lane_sums(sums[r] + k, row + k);
    for (; k < n; ++k) row[k] = lane_sum<float>(sums[r][k]);
  }
}

template <int64_t Type>
inline void few_row_scores(const float* q, int64_t rows, int64_t d_size, const RawRows<Type>& keys, int64_t n,
                           float* s) {
  switch (rows) {
    case 1: few_row_scores<Type, 1>(q, d_size, keys, n, s); break;
    case 2: few_row_scores<Type, 2>(q, d_size, keys, n, s); break;
    default: few_row_scores<Type, 3>(q, d_size, keys, n, s); break;
  }
}

// Per-item scratch space, reused across the items a thread runs.
template <typename Acc>
struct Scratch {
  std::vector<Acc> q, acc, m, l, scores, transposed, rows_buffer;
  std::vector<const Acc*> key_rows, value_rows;
  std::vector<const char*> raw_keys, raw_values;   // the few-row path's rows, read in place
  void resize(int64_t rows, int64_t kv_heads, int64_t d_size) {
    q.resize(rows * d_size);
    acc.assign(rows * d_size, Acc(0));
    m.assign(rows, -std::numeric_limits<Acc>::infinity());
    l.assign(rows, Acc(0));
    scores.resize(rows * kKeyTile);
    transposed.resize(d_size * kKeyTile);
    rows_buffer.resize(kKeyTile * kv_heads * d_size);
    key_rows.resize(kKeyTile * kv_heads);
    value_rows.resize(kKeyTile * kv_heads);
    raw_keys.resize(kKeyTile * kv_heads);
    raw_values.resize(kKeyTile * kv_heads);
  }
};

// The largest of n >= 1 scores (any order gives the same maximum; float through vectors).
template <typename Acc>
inline Acc tile_maximum(const Acc* s, int64_t n) {
  Acc best = s[0];
  for (int64_t k = 1; k < n; ++k) best = std::max(best, s[k]);
  return best;
}

template <>
inline float tile_maximum<float>(const float* s, int64_t n) {
  constexpr int64_t L = Vector<float>::lanes;
  if (n < L) {
    float best = s[0];
    for (int64_t k = 1; k < n; ++k) best = std::max(best, s[k]);
    return best;
  }
  FloatVector best = load(s);
  int64_t k = L;
  for (; k + L <= n; k += L) {
    const FloatVector v = load(s + k);
    best = v > best ? v : best;
  }
  float out = best[0];
  for (int64_t j = 1; j < L; ++j) out = std::max(out, best[j]);
  for (; k < n; ++k) out = std::max(out, s[k]);
  return out;
}

// The sum of n weights: float in vector lanes (then lane_sum and a scalar tail), double in order.
template <typename Acc>
inline Acc tile_sum(const Acc* s, int64_t n) {
  Acc sum = 0;
  for (int64_t k = 0; k < n; ++k) sum += s[k];
  return sum;
}

template <>
inline float tile_sum<float>(const float* s, int64_t n) {
  constexpr int64_t L = Vector<float>::lanes;
  FloatVector lanes = {};
  int64_t k = 0;
  for (; k + L <= n; k += L) lanes += load(s + k);
  float sum = lane_sum<float>(lanes);
  for (; k < n; ++k) sum += s[k];
  return sum;
}

// Online-softmax update of one row with the scores s[lo:hi) of a tile (the row's visible keys in it):
// s becomes the weights (zero outside [lo, hi)), acc is rescaled, m and l are updated.
template <typename Acc>
void softmax_update(Acc* s, int64_t lo, int64_t hi, int64_t n, Acc softcap, Acc& m, Acc& l, Acc* acc,
                    int64_t d_size) {
  if (softcap > 0)
    for (int64_t k = lo; k < hi; ++k) s[k] = std::tanh(s[k] / softcap) * softcap;
  const Acc new_max = std::max(m, tile_maximum(s + lo, hi - lo));
  for (int64_t k = lo; k < hi; ++k) s[k] -= new_max;
  exp_nonpositive(s + lo, hi - lo);
  const Acc sum = tile_sum(s + lo, hi - lo);
  for (int64_t k = 0; k < lo; ++k) s[k] = 0;
  for (int64_t k = hi; k < n; ++k) s[k] = 0;
  const Acc alpha = m == -std::numeric_limits<Acc>::infinity() ? Acc(0) : std::exp(m - new_max);
  l = l * alpha + sum;
  m = new_max;
  if (alpha != Acc(1))
    for (int64_t d = 0; d < d_size; ++d) acc[d] *= alpha;
}

// Key tiles ahead of the one being computed whose K and V rows are prefetched into L2. A step's cache rows come
// from memory (the weights read between two layers evict them), scattered over blocks that the hardware
// prefetchers do not follow; on a 2-core AVX2 EPYC, 16 decode rows over 230 bfloat16 keys each: 0.72 -> 0.53 ms
// per layer. Always inlined: as a function of its own, which only prefetches, GCC found it free of effects and
// removed its calls.
constexpr int64_t kPrefetchTiles = 2;

template <int64_t Type, typename Acc>
__attribute__((always_inline)) inline void prefetch_tile(const Params<Acc>& p, const int64_t* table,
                                                         const WorkItem& item, int64_t tile, int64_t last_pos) {
  constexpr int64_t bytes = entry_bytes(Type);
  const int64_t row_bytes = p.head_size * bytes;
  const char* const keys = static_cast<const char*>(p.key_cache);
  const char* const values = static_cast<const char*>(p.value_cache);
  for (int64_t pos = tile; pos < std::min(tile + kKeyTile, last_pos + 1); ++pos) {
    const int64_t block = table[pos / p.block_size], offset = pos % p.block_size;
    const char* k = keys + (block * p.k_strides[0] + offset * p.k_strides[1] + item.kv_begin * p.k_strides[2]) * bytes;
    const char* v = values + (block * p.v_strides[0] + offset * p.v_strides[1] + item.kv_begin * p.v_strides[2]) * bytes;
    for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh, k += p.k_strides[2] * bytes, v += p.v_strides[2] * bytes)
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(k + b, 0, 1);
        __builtin_prefetch(v + b, 0, 1);
      }
  }
}

// Pointers to the cache rows of keys [tile, tile + n) for the item's KV heads: rows[kh * kKeyTile + k].
template <int64_t Type>
inline void gather_rows(const void* cache, const int64_t* strides, const int64_t* table, int64_t block_size,
                        int64_t tile, int64_t n, const WorkItem& item, const char** rows) {
  const char* base = static_cast<const char*>(cache);
  constexpr int64_t bytes = entry_bytes(Type);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t pos = tile + k;
    const char* slot = base + (table[pos / block_size] * strides[0] + (pos % block_size) * strides[1]) * bytes;
    for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh) rows[kh * kKeyTile + k] = slot + kh * strides[2] * bytes;
  }
}

template <typename Acc, int64_t Type>
void attend_item(const Params<Acc>& p, const WorkItem& item, Scratch<Acc>& w) {
  const int64_t heads = p.num_heads, kv_heads = p.num_kv_heads, group = heads / kv_heads, d_size = p.head_size;
  const int64_t num_tokens = item.row_end - item.row_begin, rows = num_tokens * heads;
  const int64_t seq_begin = p.query_start[item.seq], q_len = p.query_start[item.seq + 1] - seq_begin;
  const int64_t first_pos = p.context_lens[item.seq] - q_len + (item.row_begin - seq_begin);  // first row's token
  const int64_t last_pos = first_pos + num_tokens - 1;
  const int64_t window = p.sliding_window;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t* table = p.block_tables + item.seq * p.table_width;
  w.resize(rows, kv_heads, d_size);

  // Rows are ordered (KV head, token, head within the item's part of the group), so each KV head's rows are
  // contiguous; query head kh * group + g0 + g.
  const int64_t g0 = item.g_begin, g_rows = item.g_end - item.g_begin;
  auto row_of = [&](int64_t kv_head, int64_t t, int64_t g) { return (kv_head * num_tokens + t) * g_rows + g; };
  for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh)
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t g = 0; g < g_rows; ++g) {
        const Acc* src = p.query + ((item.row_begin + t) * heads + kh * group + g0 + g) * d_size;
        Acc* dst = w.q.data() + row_of(kh, t, g) * d_size;
        for (int64_t d = 0; d < d_size; ++d) dst[d] = src[d] * p.scale;
      }
  const int64_t kv_rows = num_tokens * g_rows;
  // float32 queries over a cache of any type but float64, with fewer than kRowBlock rows per KV head (decode)
  // and a head size of whole vectors: cache rows read in place (RawRows)
  constexpr bool kInPlace = std::is_same_v<Acc, float> && Type != kF64;
  const bool in_place = kInPlace && kv_rows < kRowBlock && d_size % Vector<float>::lanes == 0;
  for (int64_t ahead = 0; ahead < kPrefetchTiles; ++ahead)
    prefetch_tile<Type>(p, table, item, first_key + ahead * kKeyTile, last_pos);
  for (int64_t tile = first_key; tile <= last_pos; tile += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last_pos + 1 - tile);
    prefetch_tile<Type>(p, table, item, tile + kPrefetchTiles * kKeyTile, last_pos);
    if constexpr (kInPlace) {
      if (in_place) {
        gather_rows<Type>(p.key_cache, p.k_strides, table, p.block_size, tile, n, item, w.raw_keys.data());
        for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh)
          few_row_scores<Type>(w.q.data() + kh * kv_rows * d_size, kv_rows, d_size,
                               RawRows<Type>{w.raw_keys.data() + kh * kKeyTile}, n,
                               w.scores.data() + kh * kv_rows * kKeyTile);
      }
    }
    if (!in_place) {
      for (int64_t k = 0; k < n; ++k) {
        const int64_t pos = tile + k, block = table[pos / p.block_size], offset = pos % p.block_size;
        const int64_t k_base = block * p.k_strides[0] + offset * p.k_strides[1];
        for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh) {
          const int64_t slot = kh * kKeyTile + k;
          w.key_rows[slot] = cache_row<Acc, Type>(p.key_cache, k_base + kh * p.k_strides[2], d_size,
                                                  w.rows_buffer.data() + slot * d_size);
        }
      }
      for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh) {
        Acc* s = w.scores.data() + kh * kv_rows * kKeyTile;
        tile_scores(w.q.data() + kh * kv_rows * d_size, kv_rows, w.key_rows.data() + kh * kKeyTile, n, d_size, s,
                    w.transposed.data());
      }
    }
    for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh)
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t qpos = first_pos + t;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, qpos - window + 1 - tile) : 0;
        const int64_t hi = std::min(n, qpos + 1 - tile);
        for (int64_t g = 0; g < g_rows; ++g) {
          const int64_t r = row_of(kh, t, g);
          Acc* s = w.scores.data() + r * kKeyTile;
          if (hi <= lo) {
            for (int64_t k = 0; k < n; ++k) s[k] = 0;
            continue;
          }
          softmax_update(s, lo, hi, n, p.softcap, w.m[r], w.l[r], w.acc.data() + r * d_size, d_size);
        }
      }
    if constexpr (kInPlace) {
      if (in_place) {
        gather_rows<Type>(p.value_cache, p.v_strides, table, p.block_size, tile, n, item, w.raw_values.data());
        for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh)
          accumulate_rows(w.acc.data() + kh * kv_rows * d_size, w.scores.data() + kh * kv_rows * kKeyTile,
                          RawRows<Type>{w.raw_values.data() + kh * kKeyTile}, n, d_size, kv_rows);
        continue;
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t pos = tile + k;
      const int64_t base = table[pos / p.block_size] * p.v_strides[0] + (pos % p.block_size) * p.v_strides[1];
      for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh) {
        const int64_t slot = kh * kKeyTile + k;
        w.value_rows[slot] = cache_row<Acc, Type>(p.value_cache, base + kh * p.v_strides[2], d_size,
                                                  w.rows_buffer.data() + slot * d_size);
      }
    }
    for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh) {
      const int64_t r = kh * kv_rows;
      accumulate_rows(w.acc.data() + r * d_size, w.scores.data() + r * kKeyTile,
                      CopiedRows<Acc>{w.value_rows.data() + kh * kKeyTile}, n, d_size, kv_rows);
    }
  }
  for (int64_t kh = item.kv_begin; kh < item.kv_end; ++kh)
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t g = 0; g < g_rows; ++g) {
        const int64_t r = row_of(kh, t, g), head = kh * group + g0 + g;
        Acc denom = w.l[r];
        if (p.sinks != nullptr) denom += std::exp(p.sinks[head] - w.m[r]);
        const Acc factor = p.v_scale / denom;
        const Acc* a = w.acc.data() + r * d_size;
        Acc* dst = p.out + ((item.row_begin + t) * heads + head) * d_size;
        for (int64_t d = 0; d < d_size; ++d) dst[d] = a[d] * factor;
      }
}

// Query tiles with all their KV heads, so each K/V row is read once (one item each, shared among the threads as they
// come). Where there are fewer tiles than threads (a decode step of fewer sequences than cores) each tile's query
// heads are split into `parts` equal shares in (KV head, head within its group) order instead, one per thread: a
// share is whole KV heads, or parts of a group where their number of rows stays below kRowBlock (the few-row path,
// as the whole group's), a KV head split so having its K/V rows read by each share. At batch 1 with smollm2's 3 KV
// heads of 3 query heads on 2 threads, 5 and 4 query heads instead of 2 and 1 KV heads (6 and 3). Heads do not
// interact: the results are the same bit for bit.
struct WorkPlan {
  std::vector<WorkItem> items;
  std::vector<int64_t> shares;   // share c: items [shares[c], shares[c + 1]); empty: every item on its own
};

// A tile's query heads [u0, u1) in (KV head, head within the group) order, as items of whole KV heads or of one KV
// head's part of its group.
void share_items(const WorkItem& tile, int64_t group, int64_t u0, int64_t u1, std::vector<WorkItem>& out) {
  while (u0 < u1) {
    const int64_t kh = u0 / group, g = u0 % group;
    if (g == 0 && u1 - u0 >= group) {   // whole KV heads
      const int64_t whole = (u1 - u0) / group;
      out.push_back({tile.seq, tile.row_begin, tile.row_end, kh, kh + whole, 0, group});
      u0 += whole * group;
      continue;
    }
    const int64_t g_end = std::min(group, g + (u1 - u0));
    out.push_back({tile.seq, tile.row_begin, tile.row_end, kh, kh + 1, g, g_end});
    u0 += g_end - g;
  }
}

WorkPlan work_items(const int64_t* query_start, int64_t num_seqs, int64_t kv_heads, int64_t group,
                    int64_t num_threads) {
  WorkPlan plan;
  std::vector<WorkItem>& items = plan.items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t row = query_start[s]; row < query_start[s + 1]; row += kQueryTile)
      items.push_back({s, row, std::min(row + kQueryTile, query_start[s + 1]), 0, kv_heads, 0, group});
  }
  const int64_t tiles = int64_t(items.size());
  if (tiles == 0 || tiles >= num_threads || kv_heads * group < 2) return plan;
  const std::vector<WorkItem> whole = items;
  items.clear();
  for (const WorkItem& tile : whole) {
    // a group's rows split only while each part keeps the whole group's few-row path
    const bool split_groups = (tile.row_end - tile.row_begin) * group < kRowBlock;
    const int64_t units = split_groups ? kv_heads * group : kv_heads, unit = split_groups ? 1 : group;
    const int64_t parts = std::min(units, (num_threads + tiles - 1) / tiles);
    for (int64_t part = 0; part < parts; ++part) {
      plan.shares.push_back(int64_t(items.size()));
      share_items(tile, group, units * part / parts * unit, units * (part + 1) / parts * unit, items);
    }
  }
  plan.shares.push_back(int64_t(items.size()));
  return plan;
}

template <typename Acc, int64_t Type>
void run(const Params<Acc>& p, int64_t num_seqs, int64_t num_threads) {
  const WorkPlan plan = work_items(p.query_start, num_seqs, p.num_kv_heads, p.num_heads / p.num_kv_heads,
                                   num_threads);
  const std::vector<WorkItem>& items = plan.items;
  const int64_t total = int64_t(items.size());
  const int64_t shares = plan.shares.empty() ? 0 : int64_t(plan.shares.size()) - 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && total > 1)
  {
    // per thread and kept between calls: a decode step calls the kernel once per layer, and allocating the
    // scratch vectors each time cost as much as attending over a short context
    static thread_local Scratch<Acc> scratch;
    if (shares > 0) {   // share c on thread c (modulo the threads the team has)
      for (int64_t c = omp_get_thread_num(); c < shares; c += omp_get_num_threads())
        for (int64_t i = plan.shares[c]; i < plan.shares[c + 1]; ++i) attend_item<Acc, Type>(p, items[i], scratch);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < total; ++i) attend_item<Acc, Type>(p, items[i], scratch);
    }
  }
}

template <typename Acc>
int dispatch(const Params<Acc>& p, int64_t cache_type, int64_t num_seqs, int64_t num_threads) {
  switch (cache_type) {
    case kF32: run<Acc, kF32>(p, num_seqs, num_threads); return 0;
    case kF64: run<Acc, kF64>(p, num_seqs, num_threads); return 0;
    case kF16: run<Acc, kF16>(p, num_seqs, num_threads); return 0;
    case kBF16: run<Acc, kBF16>(p, num_seqs, num_threads); return 0;
    case kE4M3: run<Acc, kE4M3>(p, num_seqs, num_threads); return 0;
    case kE5M2: run<Acc, kE5M2>(p, num_seqs, num_threads); return 0;
    default: return 1;
  }
}

template <typename Acc>
int paged_attention(const void* query, void* out, const void* key_cache, const void* value_cache,
                    const int64_t* k_strides, const int64_t* v_strides, const int64_t* block_tables,
                    int64_t table_width, const int64_t* context_lens, const int64_t* query_start, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                    int64_t cache_type, double scale, double v_scale, int64_t sliding_window, double softcap,
                    const void* sinks, int64_t num_threads) {
  Params<Acc> p{static_cast<const Acc*>(query), static_cast<Acc*>(out), key_cache, value_cache,
                {k_strides[0], k_strides[1], k_strides[2]}, {v_strides[0], v_strides[1], v_strides[2]},
                block_tables, table_width, context_lens, query_start, num_heads, num_kv_heads, head_size,
                block_size, Acc(scale), Acc(v_scale), sliding_window, Acc(softcap), static_cast<const Acc*>(sinks)};
  return dispatch<Acc>(p, cache_type, num_seqs, num_threads);
}

// A step's metadata checked once, before any layer reads or writes through it: 0 when every entry a kernel will
// use is valid, else the first problem's code (kernels/cpu.py's STEP_PROBLEMS names them): 1 query_start does
// not start at 0 or decreases, 2 a context length is shorter than its new tokens or longer than its table row, 3
// a table entry attention reads (from the window of the sequence's first new token to its last key) lies outside
// the cache, 4 a slot (null slots: none) lies outside the cache.
int64_t check_step_metadata(const int64_t* tables, int64_t width, const int64_t* context_lens,
                            const int64_t* query_start, int64_t num_seqs, const int64_t* slots, int64_t num_slots,
                            int64_t block_size, int64_t num_blocks, int64_t window) {
  if (num_seqs > 0 && query_start[0] != 0) return 1;
  for (int64_t s = 0; s < num_seqs; ++s)
    if (query_start[s + 1] < query_start[s]) return 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = context_lens[s], q_len = query_start[s + 1] - query_start[s];
    if (length < q_len || length > width * block_size) return 2;
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = context_lens[s], q_len = query_start[s + 1] - query_start[s];
    if (q_len == 0) continue;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, length - q_len - window + 1) : 0;
    for (int64_t col = first_key / block_size; col * block_size < length; ++col) {
      const int64_t block = tables[s * width + col];
      if (block < 0 || block >= num_blocks) return 3;
    }
  }
  for (int64_t t = 0; slots != nullptr && t < num_slots; ++t)
    if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return 4;
  return 0;
}

// The per-step arguments of attend_and_cache, packed once per step by kernels/cpu.py (StepArgs) as int64.
enum StepField : int64_t {
  kTables = 0, kTableWidth, kContextLens, kQueryStart, kNumSeqs, kHeads, kKvHeads, kHeadSize, kBlockSize, kCacheType,
  kKeyStrides, kValueStrides = kKeyStrides + 3, kSlots = kValueStrides + 3, kNumTokens, kElemBytes, kWindow, kThreads,
  kStepFields
};

// Byte copies of the step's new K or V rows ([num_tokens, kv_heads, head_size], last dim contiguous, strides in
// elements) into their cache slots; the caller checked the dtype (the cache's), the scales (none) and the slots.
void write_rows(const int64_t* step, const void* rows, int64_t token_stride, int64_t head_stride, void* cache,
                const int64_t* cache_strides) {
  const int64_t* slots = reinterpret_cast<const int64_t*>(step[kSlots]);
  const int64_t bytes = step[kElemBytes], row_bytes = step[kHeadSize] * bytes, block_size = step[kBlockSize];
  const char* src = static_cast<const char*>(rows);
  char* dst = static_cast<char*>(cache);
  for (int64_t t = 0; t < step[kNumTokens]; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < step[kKvHeads]; ++h)
      std::memcpy(dst + (block * cache_strides[0] + offset * cache_strides[1] + h * cache_strides[2]) * bytes,
                  src + (t * token_stride + h * head_stride) * bytes, row_bytes);
  }
}

template <typename Acc>
int attend_and_cache(const int64_t* step, const void* query, void* out, const void* new_key, const void* new_value,
                     int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
                     int64_t value_head_stride, void* key_cache, void* value_cache, double scale, double v_scale,
                     double softcap, const void* sinks) {
  if (new_key != nullptr) {
    write_rows(step, new_key, key_token_stride, key_head_stride, key_cache, step + kKeyStrides);
    write_rows(step, new_value, value_token_stride, value_head_stride, value_cache, step + kValueStrides);
  }
  return paged_attention<Acc>(query, out, key_cache, value_cache, step + kKeyStrides, step + kValueStrides,
                              reinterpret_cast<const int64_t*>(step[kTables]), step[kTableWidth],
                              reinterpret_cast<const int64_t*>(step[kContextLens]),
                              reinterpret_cast<const int64_t*>(step[kQueryStart]), step[kNumSeqs], step[kHeads],
                              step[kKvHeads], step[kHeadSize], step[kBlockSize], step[kCacheType], scale, v_scale,
                              step[kWindow], softcap, sinks, step[kThreads]);
}

}  // namespace

extern "C" {

// The vector width this build uses, in bytes (64 where it targets AVX-512, else 32): see cpu_features.py.
int64_t vector_bytes() { return cpu_kernels::kVectorBytes; }

// Returns 0 on success, 1 for an unknown cache type. `query`, `out` and `sinks` are float32
// (paged_attention_f32) or float64 (paged_attention_f64); the caller validates shapes.
int paged_attention_f32(const void* query, void* out, const void* key_cache, const void* value_cache,
                        const int64_t* k_strides, const int64_t* v_strides, const int64_t* block_tables,
                        int64_t table_width, const int64_t* context_lens, const int64_t* query_start,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                        int64_t block_size, int64_t cache_type, double scale, double v_scale,
                        int64_t sliding_window, double softcap, const void* sinks, int64_t num_threads) {
  return paged_attention<float>(query, out, key_cache, value_cache, k_strides, v_strides, block_tables, table_width,
                                context_lens, query_start, num_seqs, num_heads, num_kv_heads, head_size, block_size,
                                cache_type, scale, v_scale, sliding_window, softcap, sinks, num_threads);
}

int paged_attention_f64(const void* query, void* out, const void* key_cache, const void* value_cache,
                        const int64_t* k_strides, const int64_t* v_strides, const int64_t* block_tables,
                        int64_t table_width, const int64_t* context_lens, const int64_t* query_start,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                        int64_t block_size, int64_t cache_type, double scale, double v_scale,
                        int64_t sliding_window, double softcap, const void* sinks, int64_t num_threads) {
  return paged_attention<double>(query, out, key_cache, value_cache, k_strides, v_strides, block_tables,
                                 table_width, context_lens, query_start, num_seqs, num_heads, num_kv_heads,
                                 head_size, block_size, cache_type, scale, v_scale, sliding_window, softcap, sinks,
                                 num_threads);
}

// One attention layer of a step in one call: the new K/V rows written into their slots (skipped when new_key is
// null: the caller wrote them), then paged attention as above. `step` is the StepField array; returns as above.
int attend_and_cache_f32(const int64_t* step, const void* query, void* out, const void* new_key,
                         const void* new_value, int64_t key_token_stride, int64_t key_head_stride,
                         int64_t value_token_stride, int64_t value_head_stride, void* key_cache, void* value_cache,
                         double scale, double v_scale, double softcap, const void* sinks) {
  return attend_and_cache<float>(step, query, out, new_key, new_value, key_token_stride, key_head_stride,
                                 value_token_stride, value_head_stride, key_cache, value_cache, scale, v_scale,
                                 softcap, sinks);
}

int attend_and_cache_f64(const int64_t* step, const void* query, void* out, const void* new_key,
                         const void* new_value, int64_t key_token_stride, int64_t key_head_stride,
                         int64_t value_token_stride, int64_t value_head_stride, void* key_cache, void* value_cache,
                         double scale, double v_scale, double softcap, const void* sinks) {
  return attend_and_cache<double>(step, query, out, new_key, new_value, key_token_stride, key_head_stride,
                                  value_token_stride, value_head_stride, key_cache, value_cache, scale, v_scale,
                                  softcap, sinks);
}

int64_t step_fields() { return kStepFields; }

int64_t check_step(const int64_t* tables, int64_t width, const int64_t* context_lens, const int64_t* query_start,
                   int64_t num_seqs, const int64_t* slots, int64_t num_slots, int64_t block_size, int64_t num_blocks,
                   int64_t window) {
  return check_step_metadata(tables, width, context_lens, query_start, num_seqs, slots, num_slots, block_size,
                             num_blocks, window);
}

}  // extern "C"
