"""Build and load the CPU kernels (`cpu_attention.cpp`, `cpu_sampler.cpp`) once per machine, through ctypes; and
`cpu_linear_op.cpp` (with `cpu_linear.cpp`'s kernel) as a library of PyTorch operators (`load_torch_ops`).

The kernels' sources are plain C++17 with OpenMP and no PyTorch headers, so each builds in a few seconds with the
system compiler: `$CXX`, a command split as a shell would (`CXX="ccache g++"` runs g++ through ccache),
else `c++`, `g++` or `clang++`. A shared library is cached under `$PAGED_BACKEND_CACHE/kernels` (default
`~/.cache/paged_backend/kernels`), named by a hash of the sources, the flags, the compiler command and
version and the CPU, and written atomically (parallel test processes may race). OpenMP comes from the
`libgomp.so.1` PyTorch has already loaded, so the kernels' threads are PyTorch's. When the compiler fails,
`load_library(name)` logs why once (a warning), returns None and keeps the reason in `build_error(name)`;
callers fall back to PyTorch code. `cpu_linear_op.cpp` is the exception: an operator that compiled code calls a
few hundred times per step must not pass through Python, so it is built against PyTorch's headers (about 10 s,
once per machine and PyTorch version) and loaded with `torch.ops.load_library`; where it cannot be built, the
layers it would serve keep PyTorch's linear.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).parent
HEADERS = ("cpu_vector.h",)
_FLAG_SETS: List[List[str]] = [
    ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"],   # compilers without -march=native
]
_errors: Dict[str, str] = {}
logger = logging.getLogger(__name__)

_p, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
# The exported functions of each library: name -> (restype, argtypes).
FUNCTIONS: Dict[str, Dict[str, Tuple[type, List[type]]]] = {
    # (query, out, key_cache, value_cache, k_strides, v_strides, block_tables, table_width, context_lens,
    #  query_start, num_seqs, num_heads, num_kv_heads, head_size, block_size, cache_type, scale, v_scale,
    #  sliding_window, softcap, sinks, num_threads)
    "cpu_attention": {name: (ctypes.c_int, [_p, _p, _p, _p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64,
                                            _i64, _f64, _f64, _i64, _f64, _p, _i64])
                      for name in ("paged_attention_f32", "paged_attention_f64")}
                     # (step fields, query, out, new_key, new_value, key token/head strides, value token/head
                     #  strides, key_cache, value_cache, scale, v_scale, softcap, sinks)
                     | {name: (ctypes.c_int, [_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _p, _f64, _f64, _f64, _p])
                        for name in ("attend_and_cache_f32", "attend_and_cache_f64")}
                     # (tables, width, context_lens, query_start, num_seqs, slots, num_slots, block_size,
                     #  num_blocks, window)
                     | {"check_step": (ctypes.c_int64, [_p, _i64, _p, _p, _i64, _p, _i64, _i64, _i64, _i64])}
                     | {"step_fields": (ctypes.c_int64, []),      # the length of attend_and_cache's step array
                        "vector_bytes": (ctypes.c_int64, [])},   # the build's vector width (cpu_features.py)
    # (logits, row_stride, num_rows, vocab, top_k, top_p, min_p, greedy, uniforms, draw_offsets, tokens,
    #  logprobs, kept, log_norm, num_threads)
    "cpu_sampler": {"sample_rows": (ctypes.c_int64, [_p, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p,
                                                     _i64]),
                    # (logits, row_stride, num_rows, vocab, with_norms, tokens, log_norm, num_threads)
                    "greedy_rows": (ctypes.c_int64, [_p, _i64, _i64, _i64, ctypes.c_uint8, _p, _p, _i64])},
}


def cache_root() -> Path:
    root = os.environ.get("PAGED_BACKEND_CACHE") or os.path.join(Path.home(), ".cache", "paged_backend")
    return Path(root) / "kernels"


def compiler_command() -> Tuple[Optional[List[str]], str]:
    """The compiler as a command line (`$CXX` split as a shell would, its program resolved on PATH; without
    CXX the first of c++, g++, clang++), or None and why there is none."""
    cxx = os.environ.get("CXX", "").strip()
    if not cxx:
        found = next((path for path in map(shutil.which, ("c++", "g++", "clang++")) if path), None)
        return ([found], "") if found else (None, "no C++ compiler found (c++, g++ or clang++; set CXX)")
    try:
        program, *args = shlex.split(cxx)
    except ValueError as exc:
        return None, f"CXX={cxx!r} is not a command line: {exc}"
    path = shutil.which(program)
    if path is None:
        return None, f"CXX={cxx!r}: {program!r} is not an executable file or a program on PATH"
    return [path, *args], ""


def _cpu_identity() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _library_path(name: str, compiler: List[str], flags: List[str]) -> Path:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    sources = [(HERE / f"{name}.cpp").read_text()] + [(HERE / header).read_text() for header in HEADERS]
    digest = hashlib.sha256("\0".join(sources + [" ".join(flags), " ".join(compiler), version, _cpu_identity()])
                            .encode()).hexdigest()[:16]
    return cache_root() / f"{name}-{digest}.so"


def _compile(source: Path, compiler: List[str], flags: List[str], target: Path,
             libraries: Tuple[str, ...] = ()) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([*compiler, *flags, str(source), "-o", tmp, *libraries], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip()[-2000:] or f"{compiler[0]} exited with {result.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(name: str, library: ctypes.CDLL) -> ctypes.CDLL:
    for function_name, (restype, argtypes) in FUNCTIONS[name].items():
        function = getattr(library, function_name)
        function.restype = restype
        function.argtypes = argtypes
    return library


@lru_cache(maxsize=None)
def load_library(name: str) -> Optional[ctypes.CDLL]:
    """The compiled library `name` (a key of FUNCTIONS; built on first use), or None when it cannot be built
    (the reason logged once, as a warning, and kept in `build_error(name)`)."""
    _errors.pop(name, None)
    library = _build_and_load(name)
    if library is None:
        logger.warning("the C++ kernel %s cannot be built; its PyTorch version runs instead: %s", name, _errors[name])
    return library


def _build_and_load(name: str) -> Optional[ctypes.CDLL]:
    compiler, why = compiler_command()
    if compiler is None:
        _errors[name] = why
        return None
    errors = []
    for flags in _FLAG_SETS:
        try:
            path = _library_path(name, compiler, flags)
            if not path.exists():
                _compile(HERE / f"{name}.cpp", compiler, flags, path)
            return _bind(name, ctypes.CDLL(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    _errors[name] = f"{' '.join(compiler)} could not build {name}.cpp: " + " | ".join(errors)
    return None


def build_error(name: str) -> Optional[str]:
    """Why library `name` could not be built (None when it was, or before the first attempt)."""
    return _errors.get(name)


# Libraries of PyTorch operators (built against PyTorch's headers, loaded with torch.ops.load_library): name ->
# the other sources of this folder it includes (part of its cache key).
TORCH_OP_LIBRARIES: Dict[str, Tuple[str, ...]] = {"cpu_linear_op": ("cpu_linear.cpp",),
                                                  "cpu_attention_op": ("cpu_attention.cpp",)}


def _torch_flags() -> List[str]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    flags = ["-O3", "-march=native", "-std=c++20", "-fopenmp", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-I{path}" for path in include_paths()]
    for path in library_paths():
        flags += [f"-L{path}", f"-Wl,-rpath,{path}"]
    return flags


# after the source on the command line: a linker with --as-needed drops libraries named before what needs them
_TORCH_LIBRARIES = ("-ltorch", "-ltorch_cpu", "-lc10")


@lru_cache(maxsize=None)
def load_torch_ops(name: str) -> bool:
    """Build (once per machine and PyTorch version; about 10 s) and load the operator library `name` (a key of
    TORCH_OP_LIBRARIES); False when it cannot be (the reason logged once and kept in `build_error(name)`)."""
    import torch

    _errors.pop(name, None)
    compiler, why = compiler_command()
    try:
        if compiler is None:
            raise RuntimeError(why)
        flags = _torch_flags()
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        sources = [(HERE / f"{name}.cpp").read_text()] + [(HERE / f).read_text()
                                                          for f in TORCH_OP_LIBRARIES[name] + HEADERS]
        digest = hashlib.sha256("\0".join(sources + [" ".join(flags + list(_TORCH_LIBRARIES)), " ".join(compiler),
                                                     version, torch.__version__,
                                                     _cpu_identity()]).encode()).hexdigest()[:16]
        path = cache_root() / f"{name}-{digest}.so"
        if not path.exists():
            _compile(HERE / f"{name}.cpp", compiler, flags, path, _TORCH_LIBRARIES)
        torch.ops.load_library(str(path))
        return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _errors[name] = f"could not build {name}.cpp against PyTorch's headers: {exc}"
        logger.warning("the C++ operator library %s cannot be built; PyTorch's code runs instead: %s", name,
                       _errors[name])
        return False
