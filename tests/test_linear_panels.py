"""How the linear kernel's blocked product (kernels/cpu_linear.cpp) lays x's rows out in panels: whole panels of
two vectors, then the rest in the narrowest panels that hold it. Float32 tiles with AVX-512 pad the rest to a
multiple of half a vector (17 to 24 rows left take a panel of one vector and one of half: a decode step of 17 to
24 sequences computes 24 lanes, not 32); bfloat16 through vdpbf16ps keeps one padded panel there (its half-vector
tile costs a whole vector's time). Compiled at -march=native and, on x86, at x86-64-v3 (8 lanes, no half panels).
That each row's bits do not depend on the layout: tests/test_linear_kernel.py."""

from __future__ import annotations

import kernel_harness
import pytest

HARNESS = r"""
#include "cpu_linear.cpp"
#include <cstdio>
int main() {
  std::printf("%ld %ld\n", static_cast<long>(L), static_cast<long>(kQuarter));
  for (int64_t m = 1; m <= 80; ++m)
    for (int split = 0; split < 2; ++split) {
      const PanelLayout layout(m, split == 1);
      int64_t next = 0, covered = 0;
      for (int64_t p = 0; p < layout.count; ++p) {   // panels follow one another, each as wide as it says
        covered += layout.first(p) == next;
        next = layout.first(p) + layout.width(p);
      }
      std::printf("%ld %d %ld %ld %ld\n", static_cast<long>(m), split, static_cast<long>(layout.lanes),
                  static_cast<long>(next), static_cast<long>(covered == layout.count));
    }
  return 0;
}
"""

def _expected(m: int, split: bool, lanes: int, quarter: int) -> int:
    panel = 2 * lanes
    rest = m % panel
    if rest == 0:
        tail = 0
    elif rest <= quarter:
        tail = quarter
    elif rest <= lanes:
        tail = lanes
    elif split and quarter < lanes and rest <= lanes + quarter:
        tail = lanes + quarter
    else:
        tail = panel
    return m - rest + tail


@pytest.mark.parametrize("march", kernel_harness.BUILDS)
def test_rows_left_after_whole_panels_take_the_narrowest_panels_that_hold_them(tmp_path, march):
    lines = kernel_harness.run_harness(tmp_path, HARNESS, march).splitlines()
    lanes, quarter = map(int, lines[0].split())
    rows = [tuple(map(int, line.split())) for line in lines[1:]]
    assert (lanes, quarter) in ((16, 8), (8, 8)) and len(rows) == 160
    if march == kernel_harness.AVX2:
        assert (lanes, quarter) == (8, 8)
    for m, split, padded, end, consecutive in rows:
        assert consecutive == 1 and end == padded, (m, split)
        assert padded == _expected(m, bool(split), lanes, quarter), (m, split, padded)
    if lanes == 16:   # a decode step of 20 sequences: 24 float32 lanes, bfloat16 a padded panel of 32
        padded = {(m, split): p for m, split, p, _, _ in rows}
        assert (padded[(20, 1)], padded[(20, 0)]) == (24, 32)
