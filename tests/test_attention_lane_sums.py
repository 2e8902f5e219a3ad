"""The attention kernel's float score sums (kernels/cpu_attention.cpp): the batched `lane_sums` (L vectors at once,
through shuffles) gives `lane_sum`'s tree of halves bit for bit, at every vector width the kernel builds for:
16 floats with AVX-512, 8 with AVX2 and in the portable build. Decode rows take the batched sums and the copying
path takes one tree per pair, so this is what keeps the two paths' scores equal. The widths this machine does not
run by default are compiled and run here with their own -march."""

from __future__ import annotations

import kernel_harness
import pytest

HARNESS = r"""
#include "cpu_attention.cpp"
#include <cstdio>
#include <random>
int main() {
  constexpr int64_t L = cpu_kernels::Vector<float>::lanes;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  int mismatches = 0;
  for (int rep = 0; rep < 2000; ++rep) {
    cpu_kernels::FloatVector v[L];
    float out[L];
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < L; ++j) v[i][j] = normal(gen) * float(1 << (j % 12));   // lanes of unlike magnitude
    lane_sums(v, out);
    for (int i = 0; i < L; ++i) mismatches += out[i] != lane_sum<float>(v[i]);
  }
  std::printf("%ld %d\n", static_cast<long>(L), mismatches);
  return 0;
}
"""

BUILDS = kernel_harness.BUILDS + [pytest.param([], id="portable")]


@pytest.mark.parametrize("march", BUILDS)
def test_batched_lane_sums_equal_one_tree_per_vector(tmp_path, march):
    lanes, mismatches = map(int, kernel_harness.run_harness(tmp_path, HARNESS, march).split())
    assert lanes in (8, 16)
    if march == kernel_harness.AVX2:
        assert lanes == 8
    assert mismatches == 0, f"{mismatches} of {2000 * lanes} batched sums differ from the tree at {lanes} lanes"
