// Vector helpers shared by the CPU kernels (GCC/Clang vector extensions; no intrinsics, so the same code
// builds for AVX-512, AVX2 and NEON).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpu_kernels {

// Vectors through GCC/Clang vector extensions: one AVX-512 register where the build targets it, else
// 32 bytes (one AVX register, two NEON registers).
#if defined(__AVX512F__)
constexpr int64_t kVectorBytes = 64;
#else
constexpr int64_t kVectorBytes = 32;
#endif

template <typename T>
struct Vector {
  typedef T type __attribute__((vector_size(kVectorBytes)));
  static constexpr int64_t lanes = kVectorBytes / sizeof(T);
};

typedef Vector<float>::type FloatVector;
typedef int32_t IntVector __attribute__((vector_size(kVectorBytes)));   // also what float comparisons give

template <typename Acc>
inline typename Vector<Acc>::type load(const Acc* p) {
  typename Vector<Acc>::type v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename Acc>
inline void store(Acc* p, typename Vector<Acc>::type v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename Acc>
inline Acc horizontal_sum(typename Vector<Acc>::type v) {
  Acc sum = 0;
  for (int64_t j = 0; j < Vector<Acc>::lanes; ++j) sum += v[j];
  return sum;
}

// True when any lane of a comparison result is set: OR the halves together down to 16 bytes, then lanes.
inline bool any_lane(const int32_t* lanes_begin, int64_t bytes) {
  typedef int32_t Quad __attribute__((vector_size(16)));
  Quad acc = {};
  for (int64_t offset = 0; offset < bytes; offset += 16) {
    Quad part;
    std::memcpy(&part, reinterpret_cast<const char*>(lanes_begin) + offset, 16);
    acc |= part;
  }
  return (acc[0] | acc[1] | acc[2] | acc[3]) != 0;
}

template <typename Mask>
inline bool any_lane(const Mask& mask) {
  return any_lane(reinterpret_cast<const int32_t*>(&mask), sizeof mask);
}

// exp(x) for x <= 0 in place: float through a vectorised Cephes-style polynomial (about 2 ulp; below -87,
// where exp is under float's normal range, 0 exactly, -inf included), double through std::exp (float64 is
// the exact-comparison dtype).
inline FloatVector exp_nonpositive(FloatVector input) {
  typedef FloatVector V;
  const V v = input < -87.0f ? V{} - 87.0f : input;
  const V t = v * 1.44269504088896341f;
  const V k = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const V r = (v - k * 0.693359375f) - k * -2.12194440e-4f;
  V poly = V{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const IntVector bits = (__builtin_convertvector(k, IntVector) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return input < -87.0f ? V{} : poly * scale;
}

inline void exp_nonpositive(float* x, int64_t n) {
  constexpr int64_t L = Vector<float>::lanes;
  int64_t i = 0;
  for (; i + L <= n; i += L) store(x + i, exp_nonpositive(load(x + i)));
  for (; i < n; ++i) x[i] = x[i] < -87.0f ? 0.0f : std::exp(x[i]);
}

inline void exp_nonpositive(double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

}  // namespace cpu_kernels
