"""The attention kernel's float score sums (kernels/cpu_attention.cpp): the batched `lane_sums` (L vectors at once,
through shuffles) gives `lane_sum`'s tree of halves bit for bit, at every vector width the kernel builds for:
16 floats with AVX-512, 8 with AVX2 and in the portable build. Decode rows take the batched sums and the copying
path takes one tree per pair, so this is what keeps the two paths' scores equal. The widths this machine does not
run by default are compiled and run here with their own -march."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from paged_backend.kernels import cpu_build

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

X86 = platform.machine() in ("x86_64", "AMD64")
BUILDS = [pytest.param(["-march=native"], id="native"),
          pytest.param(["-march=x86-64-v3"], id="avx2", marks=pytest.mark.skipif(not X86, reason="x86 only")),
          pytest.param([], id="portable")]


def _cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("march", BUILDS)
def test_batched_lane_sums_equal_one_tree_per_vector(tmp_path, march):
    compiler, why = cpu_build.compiler_command()
    assert compiler is not None, why
    if march == ["-march=x86-64-v3"] and not _cpu_has_avx2():
        pytest.skip("this CPU cannot run an AVX2 build")
    source = tmp_path / "lane_sums.cpp"
    source.write_text(HARNESS)
    binary = tmp_path / "lane_sums"
    kernels_dir = Path(cpu_build.HERE)
    subprocess.run([*compiler, "-O2", "-std=c++17", "-fopenmp", "-Wno-psabi", *march, f"-I{kernels_dir}",
                    str(source), "-o", str(binary)], check=True, capture_output=True, timeout=300)
    lanes, mismatches = map(int, subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                                                timeout=60).stdout.split())
    assert lanes in (8, 16)
    if march == ["-march=x86-64-v3"]:
        assert lanes == 8
    assert mismatches == 0, f"{mismatches} of {2000 * lanes} batched sums differ from the tree at {lanes} lanes"
