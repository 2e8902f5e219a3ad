"""The CPU's instruction sets, read at run time: what the C++ kernels are built for, which half-precision matmuls
oneDNN can run, and what `paged-backend info` and every benchmark record name.

Nothing is assumed about the machine: the same installation runs on an AVX2-only EPYC, an AVX-512 EPYC with
AVX512_BF16 and a Xeon with AMX. On Linux the kernel's own list of the CPU's features (`/proc/cpuinfo`: `flags`
on x86, `Features` on ARM) is the source; elsewhere the list is empty and only PyTorch's dispatch level
(`torch.backends.cpu.get_cpu_capability()`) is known. The C++ kernels are compiled on the machine that runs them
(`-march=native`, cpu_build.py), so their vector width is this CPU's; `kernel_vector_bits()` asks the built
library which width it got.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Tuple, Union

# (flag as /proc/cpuinfo spells it, the name we report), widest last within each family.
X86_SETS: Tuple[Tuple[str, str], ...] = (
    ("sse4_2", "SSE4.2"), ("avx", "AVX"), ("f16c", "F16C"), ("fma", "FMA"), ("avx2", "AVX2"),
    ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX512F"), ("avx512bw", "AVX512BW"), ("avx512vl", "AVX512VL"),
    ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"), ("avx512_fp16", "AVX512_FP16"),
    ("amx_tile", "AMX_TILE"), ("amx_bf16", "AMX_BF16"), ("amx_int8", "AMX_INT8"), ("amx_fp16", "AMX_FP16"),
)
ARM_SETS: Tuple[Tuple[str, str], ...] = (
    ("asimd", "NEON"), ("asimdhp", "NEON_FP16"), ("asimddp", "NEON_DOTPROD"), ("bf16", "BF16"), ("i8mm", "I8MM"),
    ("sve", "SVE"), ("sve2", "SVE2"),
)


@dataclass(frozen=True)
class CpuFeatures:
    """One CPU's architecture and feature flags, and what they mean for our kernels."""

    machine: str                 # platform.machine(): x86_64, aarch64, ...
    flags: FrozenSet[str]        # as the OS spells them (lower case)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def instruction_sets(self) -> List[str]:
        """The vector and matrix instruction sets the CPU has, by name (SSE4.2 ... AVX512_BF16, AMX_BF16, NEON)."""
        table = ARM_SETS if self.machine.lower() in ("aarch64", "arm64") else X86_SETS
        return [name for flag, name in table if flag in self.flags]

    def vector_bits(self) -> Optional[int]:
        """The widest SIMD register the CPU has (None when the flags are unknown)."""
        if "avx512f" in self.flags:
            return 512
        if "avx2" in self.flags or "avx" in self.flags:
            return 256
        if "asimd" in self.flags or "sse4_2" in self.flags or "sse2" in self.flags:
            return 128
        return None

    def half_precision(self) -> Dict[str, str]:
        """How bfloat16 and float16 products run on this CPU: in hardware (AMX tiles, AVX512_BF16 / AVX512_FP16
        dot products, ARM BF16) or converted to float32 first."""
        bf16 = ("AMX_BF16" if "amx_bf16" in self.flags else "AVX512_BF16" if "avx512_bf16" in self.flags
                else "BF16" if "bf16" in self.flags and self.machine.lower() in ("aarch64", "arm64")
                else "converted to float32")
        fp16 = ("AMX_FP16" if "amx_fp16" in self.flags else "AVX512_FP16" if "avx512_fp16" in self.flags
                else "NEON_FP16" if "asimdhp" in self.flags else "converted to float32")
        return {"bfloat16": bf16, "float16": fp16}


def parse_cpuinfo(text: str, machine: str) -> CpuFeatures:
    """The features `/proc/cpuinfo` text lists (its first `flags` or `Features` line)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return CpuFeatures(machine, frozenset(value.lower().split()))
    return CpuFeatures(machine, frozenset())


@lru_cache(maxsize=None)
def cpu_features() -> CpuFeatures:
    """This machine's CPU features, read once per process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine())


def torch_capability() -> str:
    """The vector level PyTorch's own CPU kernels dispatch to here (DEFAULT, AVX2, AVX512, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def onednn_half_matmuls() -> Dict[str, bool]:
    """Whether oneDNN (PyTorch's mkldnn) runs bfloat16 / float16 matmuls natively on this CPU."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return {"bfloat16": False, "float16": False}
    return {"bfloat16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "float16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}


def kernel_vector_bits() -> Optional[int]:
    """The vector width our C++ attention kernel was built with (None when it is not built)."""
    from .cpu_build import load_library

    library = load_library("cpu_attention")
    vector_bytes = getattr(library, "vector_bytes", None) if library is not None else None
    return None if vector_bytes is None else int(vector_bytes()) * 8   # None also for a build without the export


def describe() -> Dict[str, Union[str, int, bool, List[str], Dict, None]]:
    """Everything above, as plain data: for `paged-backend info` and the benchmark records' machine section."""
    features = cpu_features()
    return {"arch": features.machine, "instruction_sets": features.instruction_sets(),
            "vector_bits": features.vector_bits(), "torch_capability": torch_capability(),
            "kernel_vector_bits": kernel_vector_bits(), "half_precision": features.half_precision(),
            "onednn_half_matmuls": onednn_half_matmuls(), "linear_kernel_bfloat16": linear_kernel_bfloat16()}


def linear_kernel_bfloat16() -> str:
    """How the linear kernel multiplies bfloat16: AVX512_BF16's dot products, float32 FMAs, or not built."""
    from . import cpu_linear

    if not cpu_linear.op_available():
        return "not built"
    return "AVX512_BF16" if cpu_linear.native_bfloat16() else "float32 FMAs"


def describe_lines() -> List[str]:
    """`describe()` for people: two or three lines."""
    info = describe()
    half = info["half_precision"]
    sets = ", ".join(info["instruction_sets"]) or "unknown (no /proc/cpuinfo)"
    onednn = [name for name, native in info["onednn_half_matmuls"].items() if native]
    return [f"{info['arch']}: {sets}",
            f"vectors: {info['vector_bits'] or '?'}-bit CPU, "
            + (f"C++ kernels built for {info['kernel_vector_bits']}-bit" if info["kernel_vector_bits"]
               else "C++ kernels not built") + f", PyTorch dispatch {info['torch_capability']}",
            f"half precision: bfloat16 {half['bfloat16']}, float16 {half['float16']};"
            f" oneDNN native matmuls: {', '.join(onednn) or 'none'};"
            f" linear kernel bfloat16: {info['linear_kernel_bfloat16']}"]
