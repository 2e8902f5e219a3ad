"""Ahead-of-time compilation of a described kernel launch for a GPU target, without a GPU.

`compile_launch(launch, GPUTarget("cuda", 90, 32))` runs Triton's whole CUDA pipeline (TTIR,
TTGIR, LLVM IR, PTX and, with the `ptxas` shipped in the triton wheel, a cubin) on exactly the
arguments and constexprs a real launch would use. It catches what the CPU interpreter lets through:
`tl.dot` shapes the GPU rejects (K < 16), layout or type errors, too much shared memory.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

try:   # the JIT's own argument specialisation (Triton >= 3.4); a local equivalent otherwise
    from triton._C.libtriton import native_specialize_impl as _native_specialize
except ImportError:  # pragma: no cover - older Triton
    _native_specialize = None

from .triton_launch import Launch, is_interpreted

_POINTER_TYPES = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
}


def _type_of(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTER_TYPES:
            raise ValueError(f"argument {name}: no Triton pointer type for {value.dtype}")
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise ValueError(f"argument {name}: cannot type {type(value).__name__} for compilation")


def _specialize(name: str, value: Any) -> Tuple[str, Any]:
    """(type, specialization) the way the JIT sees an argument: ints equal to 1 and None become
    constexprs, tensors and ints divisible by 16 get a divisibility hint ('D')."""
    if _native_specialize is not None:
        return _native_specialize(CUDABackend, value, False, True, True)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
        return "constexpr", value
    aligned = (value.data_ptr() if isinstance(value, torch.Tensor) else value) % 16 == 0 \
        if isinstance(value, (torch.Tensor, int)) and not isinstance(value, bool) else False
    return _type_of(name, value), "D" if aligned else ""


def launch_signature(launch: Launch) -> Tuple[Dict[str, str], Dict[str, Any], Dict[tuple, list]]:
    """Signature, constexprs and attributes of a launch, specialised as `kernel[grid](...)` would."""
    names = list(inspect.signature(launch.kernel.fn).parameters)
    runtime_names = [n for n in names if n not in launch.constexprs]
    if len(runtime_names) != len(launch.args):
        raise ValueError(f"{launch.kernel.__name__}: {len(launch.args)} arguments for parameters {runtime_names}")
    values = dict(zip(runtime_names, launch.args))
    signature: Dict[str, str] = {}
    constexprs: Dict[str, Any] = dict(launch.constexprs)
    attrs: Dict[tuple, list] = {}
    for index, name in enumerate(names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        kind, spec = _specialize(name, values[name])
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(index,)] = CUDABackend.parse_attr(spec)
    return signature, constexprs, attrs


def compile_launch(launch: Launch, target: GPUTarget):
    """Compile the launch's kernel for `target`; raises (CompilationError & co) when the GPU compiler refuses."""
    if is_interpreted(launch.kernel):
        raise RuntimeError("the kernels were imported with TRITON_INTERPRET=1; compile them in a process without it")
    signature, constexprs, attrs = launch_signature(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=dict(launch.options))


def cuda_target(capability: int) -> GPUTarget:
    """A CUDA target such as sm_80 (80) or sm_90 (90), warp size 32."""
    return GPUTarget("cuda", capability, 32)


@dataclass
class ResourceUsage:
    """Per-thread registers and stack (spill) bytes of a compiled kernel, from the cubin."""

    registers: int
    stack_bytes: int


def resource_usage(compiled) -> ResourceUsage:
    """Read registers and stack size with the `cuobjdump` shipped next to Triton's ptxas."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True,
                                text=True, check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", report)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{report}")
    return ResourceUsage(int(found.group(1)), int(found.group(2)))
