"""Attention, cache and sampling kernels with one signature per op: Triton on CUDA tensors, compiled C++
kernels on CPU tensors, PyTorch elsewhere.

`PAGED_BACKEND_KERNELS=triton|cpp|torch` forces one implementation (with `TRITON_INTERPRET=1`,
`triton` runs the Triton kernels on the CPU, slowly; `torch` is the pure-PyTorch reference path).
`kernels_in_use(device)` says which one each op runs (shown by `paged-backend info` and the metrics); a C++
kernel that cannot be built logs why once and falls back to PyTorch (`kernel_fallback_reasons()`).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Union

import torch

from . import cpu, reference
from .reference import AttentionPlan, check_block_reads, dense_attention, plan_paged_attention
from .sampling import GreedyDraws, RowDraws, greedy_rows, greedy_tokens, sample_rows
from .sampling_device import sample_rows_nosync

_BACKENDS = ("auto", "triton", "cpp", "torch")
Plan = Union[AttentionPlan, cpu.CpuPlan]


def kernel_backend(tensor: torch.Tensor) -> str:
    """'triton', 'cpp' or 'torch' for a tensor, honouring PAGED_BACKEND_KERNELS."""
    choice = os.environ.get("PAGED_BACKEND_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"PAGED_BACKEND_KERNELS must be one of {_BACKENDS}, got {choice!r}")
    if choice == "auto":
        if tensor.is_cuda and _triton_kernels() is not None:
            return "triton"
        if tensor.device.type == "cpu" and cpu.available():
            return "cpp"
        return "torch"
    return choice


def kernels_in_use(device: Union[str, torch.device] = "cpu") -> Dict[str, str]:
    """The implementation each op runs on tensors of `device`: `attention` is 'triton', 'cpp' or 'torch' (as
    `kernel_backend` picks it), `sampler` 'cpp' or 'torch' (as `sample_rows` picks it), `linear_rows` what
    compiled code may run for linear layers: 'cpp' (cpu_linear.cpp, for the dtypes and row counts
    `cpu_linear.max_rows` gives on this CPU) or 'torch', `attend_layer` what compiled code calls per attention
    layer: 'cpp' (cpu_attention_op.cpp) or 'python' (the fallback, which calls `attention`'s kernel).
    Builds the C++ kernels if they have not been built yet."""
    from . import cpu_attention_step, cpu_linear, cpu_sampling

    probe = torch.empty(0, device=device)
    attention = kernel_backend(probe)
    cpp_sampler = probe.device.type == "cpu" and attention == "cpp" and cpu_sampling.available()
    cpp_linear = probe.device.type == "cpu" and attention == "cpp" and cpu_linear.op_available()
    cpp_attend = probe.device.type == "cpu" and attention == "cpp" and cpu_attention_step.op_available()
    return {"attention": attention, "sampler": "cpp" if cpp_sampler else "torch",
            "linear_rows": "cpp" if cpp_linear else "torch", "attend_layer": "cpp" if cpp_attend else "python"}


def kernel_fallback_reasons() -> Dict[str, str]:
    """Why each C++ kernel that was tried could not be built, by library name (empty when all built)."""
    from .cpu_build import FUNCTIONS, build_error

    return {name: build_error(name) for name in FUNCTIONS if build_error(name)}


def _triton_kernels():
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def _impl(tensor: torch.Tensor):
    backend = kernel_backend(tensor)
    if backend == "torch":
        return reference
    if backend == "cpp":
        if not cpu.available():
            from .cpu_build import build_error

            raise RuntimeError(f"PAGED_BACKEND_KERNELS=cpp but the CPU kernel cannot be built: "
                               f"{build_error('cpu_attention')}")
        return cpu
    kernels = _triton_kernels()
    if kernels is None:
        raise RuntimeError("PAGED_BACKEND_KERNELS=triton but the Triton kernels cannot be imported "
                           "(is the `triton` package installed?)")
    return kernels


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Write the step's new K/V `[num_tokens, num_kv_heads, head_size]` into their slots, as the cache's dtype
    stores them (kv_quant.py: `value / scale`, saturated for fp8)."""
    impl = _impl(key_cache)
    (reference if impl is cpu else impl).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                                           k_scale, v_scale)


def plan_attention(key_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, sliding_window: Optional[int] = None,
                   slot_mapping: Optional[torch.Tensor] = None) -> Optional[Plan]:
    """The per-step plan of the implementation that serves `key_cache` (None for Triton, which needs none);
    shared by every layer of the step with the same sliding window. With the step's `slot_mapping` the C++
    plan also checks the slots once, for `attend_and_cache`."""
    impl = _impl(key_cache)
    num_blocks, block_size = key_cache.shape[:2]
    if impl is not cpu and block_tables.device.type == "cpu":  # the C++ plan checks its reads itself; on a GPU
        # the engine checked the host tables (a check here would wait for the device every step)
        reference.check_block_reads(block_tables, context_lens, query_start_loc, block_size, num_blocks,
                                    sliding_window)
    if impl is cpu:
        return cpu.plan_paged_attention(block_tables, context_lens, query_start_loc, block_size, num_blocks,
                                        sliding_window, slot_mapping)
    if impl is reference:
        return reference.plan_paged_attention(block_tables, context_lens, query_start_loc, block_size, sliding_window)
    return None


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, out: Optional[torch.Tensor] = None,
                    plan: Optional[Plan] = None, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention over a paged KV cache for decode and (chunked) prefill queries, GQA included, with an
    optional sliding window, logit soft-cap and per-head sinks (see variant.py). The cache may hold another
    float dtype than the query, fp8 included (entries times k_scale / v_scale)."""
    impl = _impl(key_cache)
    variant = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if impl is reference or impl is cpu:
        return impl.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                    query_start_loc, scale, out=out, plan=plan, **variant)
    return impl.paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                                scale, out=out, **variant)


def attend_and_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                     plan: Optional[Plan] = None, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One attention layer of a step: `reshape_and_cache` of the new K/V, then `paged_attention`; through the
    C++ kernel one call per layer (its plan, built with the slot_mapping, checked the step once)."""
    if isinstance(plan, cpu.CpuPlan) and plan.slot_mapping is not None:   # built by the C++ path for this step
        if plan.sliding_window != sliding_window:
            raise ValueError(f"the plan was built for sliding_window={plan.sliding_window}, "
                             f"this call has sliding_window={sliding_window}")
        return cpu.attend_and_cache(query, key, value, key_cache, value_cache, plan, scale, softcap, sinks,
                                    k_scale, v_scale)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(query.contiguous(), key_cache, value_cache, block_tables, context_lens, query_start_loc,
                           scale, plan=plan, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                           k_scale=k_scale, v_scale=v_scale)


def attend_heads_first(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, plan: Optional[Plan], scale: float,
                       sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                       sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> Optional[torch.Tensor]:
    """`attend_and_cache` on transformers' layout (`[1, heads, T, D]` in, `[1, T, heads, D]` out) through the C++
    kernel with no per-call view or copy (`cpu.attend_heads_first`); None when it does not apply (another
    kernel, or inputs it cannot read in place): then call `attend_and_cache` on `[T, heads, D]` views."""
    if not isinstance(plan, cpu.CpuPlan) or plan.slot_mapping is None:
        return None
    if plan.sliding_window != sliding_window:
        raise ValueError(f"the plan was built for sliding_window={plan.sliding_window}, "
                         f"this call has sliding_window={sliding_window}")
    return cpu.attend_heads_first(query, key, value, key_cache, value_cache, plan, scale, softcap, sinks,
                                  k_scale, v_scale)


def copy_blocks(key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy blocks `src -> dst` in every layer's cache (copy-on-write)."""
    if block_mapping.numel():
        impl = _impl(key_caches[0])
        (reference if impl is cpu else impl).copy_blocks(key_caches, value_caches, block_mapping)


__all__ = ["AttentionPlan", "GreedyDraws", "RowDraws", "check_block_reads", "copy_blocks", "dense_attention",
           "greedy_rows", "greedy_tokens", "kernel_backend", "kernel_fallback_reasons", "kernels_in_use",
           "paged_attention", "plan_attention", "plan_paged_attention", "reshape_and_cache", "sample_rows",
           "sample_rows_nosync"]
