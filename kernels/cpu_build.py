"""Build and load the CPU attention kernel (`cpu_attention.cpp`) once per machine, through ctypes.

The source is plain C++17 with OpenMP and no PyTorch headers, so it builds in a few seconds with the
system compiler (`$CXX`, else `c++`). The shared library is cached under
`$PAGED_BACKEND_CACHE/kernels` (default `~/.cache/paged_backend/kernels`), named by a hash of the
source, the flags, the compiler and the CPU, and written atomically (parallel test processes may race).
OpenMP comes from the `libgomp.so.1` PyTorch has already loaded, so the kernel's threads are
PyTorch's. When no compiler works, `load_library()` returns None and says why in `build_error()`;
the caller falls back to the pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_FLAG_SETS: List[List[str]] = [
    ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC"],          # compilers without -march=native
]
_error: Optional[str] = None

_p, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
# (query, out, key_cache, value_cache, k_strides, v_strides, block_tables, table_width, context_lens,
#  query_start, num_seqs, num_heads, num_kv_heads, head_size, block_size, cache_type, scale, v_scale,
#  sliding_window, softcap, sinks, num_threads)
ATTENTION_ARGTYPES = [_p, _p, _p, _p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f64, _f64,
                      _i64, _f64, _p, _i64]


def cache_root() -> Path:
    root = os.environ.get("PAGED_BACKEND_CACHE") or os.path.join(Path.home(), ".cache", "paged_backend")
    return Path(root) / "kernels"


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def _cpu_identity() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _library_path(compiler: str, flags: List[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_identity()])
                            .encode()).hexdigest()[:16]
    return cache_root() / f"cpu_attention-{digest}.so"


def _compile(compiler: str, flags: List[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip()[-2000:] or f"{compiler} exited with {result.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name in ("paged_attention_f32", "paged_attention_f64"):
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = ATTENTION_ARGTYPES
    return library


@lru_cache(maxsize=None)
def load_library() -> Optional[ctypes.CDLL]:
    """The compiled kernel library (built on first use), or None when it cannot be built."""
    global _error
    compiler = _compiler()
    if compiler is None:
        _error = "no C++ compiler found (set CXX)"
        return None
    errors = []
    for flags in _FLAG_SETS:
        try:
            path = _library_path(compiler, flags)
            if not path.exists():
                _compile(compiler, flags, path)
            return _bind(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    _error = f"{compiler} could not build {SOURCE.name}: " + " | ".join(errors)
    return None


def build_error() -> Optional[str]:
    """Why the library could not be built (None when it was, or before the first attempt)."""
    return _error
