"""Compile and run a small C++ program that includes one of the kernels' sources (kernels/*.cpp) at a given
-march: the vector widths this machine does not build by default are checked with their own builds."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import List

import pytest

from paged_backend.kernels import cpu_build

X86 = platform.machine() in ("x86_64", "AMD64")
AVX2 = ["-march=x86-64-v3"]
BUILDS = [pytest.param(["-march=native"], id="native"),
          pytest.param(AVX2, id="avx2", marks=pytest.mark.skipif(not X86, reason="x86 only"))]


def _cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def run_harness(tmp_path: Path, source: str, march: List[str]) -> str:
    """The program's standard output; skips an AVX2 build on a CPU that cannot run it."""
    compiler, why = cpu_build.compiler_command()
    assert compiler is not None, why
    if march == AVX2 and not _cpu_has_avx2():
        pytest.skip("this CPU cannot run an AVX2 build")
    program, binary = tmp_path / "harness.cpp", tmp_path / "harness"
    program.write_text(source)
    subprocess.run([*compiler, "-O2", "-std=c++17", "-fopenmp", "-w", *march, f"-I{cpu_build.HERE}", str(program),
                    "-o", str(binary)], check=True, capture_output=True, timeout=300)
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60).stdout
