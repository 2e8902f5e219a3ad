"""Paged attention for CPU tensors through the compiled kernel (`cpu_attention.cpp`): it reads the paged
cache in place, with no gathered copy and no padding to the longest sequence.

Same signature as `reference.paged_attention` plus the fp8 scales. Queries of any float dtype are
computed in float32 (float64 queries in float64, for exact comparisons); the cache may hold float32,
float64, float16, bfloat16 or fp8 (e4m3fn, e5m2, multiplied by `k_scale` / `v_scale` as it is read).
A `CpuPlan` holds the step's metadata as int64 once for all layers and checks, once, that every
table entry the kernel will read points into the cache, so a bad table is a ValueError and never a
read outside the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from .cpu_build import build_error, load_library
from .kv_quant import check_scales
from .variant import check_attention_variant

CACHE_TYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
               torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}
QUERY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def available() -> bool:
    """True when the kernel library is (or can be) built on this machine."""
    return load_library("cpu_attention") is not None


@dataclass
class CpuPlan:
    """The step's metadata as contiguous int64 CPU tensors, checked against one cache size and window."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_blocks: int
    block_size: int
    num_query_rows: int
    sliding_window: Optional[int] = None
    slot_mapping: Optional[torch.Tensor] = None   # int64 cache slot of each new token (attend_and_cache writes)
    bound: Dict[tuple, "StepArgs"] = field(default_factory=dict)   # by cache geometry and query dtype


# What kernels/cpu_attention.cpp's check_step finds wrong, by its code (the messages of reference.check_block_reads).
STEP_PROBLEMS = {1: "query_start_loc must start at 0 and never decrease",
                 2: "each context length must cover its new tokens and fit in its block-table row",
                 3: "a block-table entry the attention reads is a hole or outside the cache of {num_blocks} blocks",
                 4: "slot_mapping holds a slot outside the cache of {slots} slots"}


def plan_paged_attention(block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         block_size: int, num_blocks: int, sliding_window: Optional[int] = None,
                         slot_mapping: Optional[torch.Tensor] = None) -> CpuPlan:
    """Convert and validate the step's metadata once (ValueError on anything the kernel cannot read or write:
    `slot_mapping`, when given, must hold one slot of the cache per new token)."""
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    starts = query_start_loc.to(torch.int64).contiguous()
    num_seqs = lens.shape[0]
    if tables.dim() != 2 or tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(tables.shape)}")
    if starts.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got {tuple(starts.shape)}")
    num_rows = int(starts[-1]) if num_seqs else 0
    slots = None
    if slot_mapping is not None:
        slots = slot_mapping.to(torch.int64).contiguous()
        if slots.shape != (max(num_rows, 0),):
            raise ValueError(f"slot_mapping must hold one slot per new token ({num_rows}), got {tuple(slots.shape)}")
    library = load_library("cpu_attention")
    if library is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {build_error('cpu_attention')}")
    # one pass in C++ over the step's metadata (a dozen small tensor operations took 0.3 ms per decode step)
    problem = library.check_step(tables.data_ptr(), tables.shape[1], lens.data_ptr(), starts.data_ptr(), num_seqs,
                                 None if slots is None else slots.data_ptr(), 0 if slots is None else slots.shape[0],
                                 block_size, num_blocks, int(sliding_window or 0))
    if problem:
        raise ValueError(STEP_PROBLEMS[problem].format(num_blocks=num_blocks, slots=num_blocks * block_size))
    return CpuPlan(tables, lens, starts, num_blocks, block_size, num_rows, sliding_window, slots)


def _check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  out: Optional[torch.Tensor]) -> None:
    if query.dim() != 3 or query.dtype not in QUERY_DTYPES:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size] of {QUERY_DTYPES}, "
                         f"got {tuple(query.shape)} {query.dtype}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_size] "
                         f"of one dtype, got {tuple(key_cache.shape)} {key_cache.dtype} and "
                         f"{tuple(value_cache.shape)} {value_cache.dtype}")
    if key_cache.dtype not in CACHE_TYPES:
        raise ValueError(f"cache dtype {key_cache.dtype} is not one of {tuple(CACHE_TYPES)}")
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size or num_heads % num_kv_heads:
        raise ValueError(f"query [*, {num_heads}, {head_size}] does not fit the cache's {num_kv_heads} KV heads "
                         f"of size {key_cache.shape[3]}")
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; the compiled kernel runs on CPU tensors")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the caches must be contiguous in their last (head_size) dimension")
    if out is not None and (out.shape != query.shape or out.device.type != "cpu"):
        raise ValueError(f"out must be a CPU tensor shaped like query {tuple(query.shape)}")


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, out: Optional[torch.Tensor] = None, plan: Optional[CpuPlan] = None,
                    sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of `query` `[num_tokens, num_heads, head_size]` over each sequence's paged context (see
    reference.paged_attention for the semantics), computed by the compiled kernel."""
    library = load_library("cpu_attention")
    if library is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {build_error('cpu_attention')}")
    _check_inputs(query, key_cache, value_cache, out)
    check_attention_variant(query.shape[1], query.device, sliding_window, softcap, sinks)
    check_scales(k_scale, v_scale)
    if plan is None:
        plan = plan_paged_attention(block_tables, context_lens, query_start_loc, key_cache.shape[1],
                                    key_cache.shape[0], sliding_window)
    elif plan.sliding_window != sliding_window:
        raise ValueError(f"the plan was built for sliding_window={plan.sliding_window}, "
                         f"this call has sliding_window={sliding_window}")
    elif plan.block_size != key_cache.shape[1] or plan.num_blocks != key_cache.shape[0]:
        raise ValueError("the plan was built for a cache of another shape")
    if plan.num_query_rows > query.shape[0]:
        raise ValueError(f"query_start_loc covers {plan.num_query_rows} query rows, the query has {query.shape[0]}")
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(acc_dtype).contiguous()
    if out is None:
        out = torch.empty_like(query)
    direct = out.dtype == acc_dtype and out.is_contiguous()
    result = out if direct else torch.empty_like(q)
    if q.shape[0]:
        sink_logits = None if sinks is None else sinks.to(acc_dtype).contiguous()
        k_strides = torch.tensor(key_cache.stride()[:3], dtype=torch.int64)
        v_strides = torch.tensor(value_cache.stride()[:3], dtype=torch.int64)
        function = library.paged_attention_f64 if acc_dtype == torch.float64 else library.paged_attention_f32
        status = function(
            q.data_ptr(), result.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), k_strides.data_ptr(),
            v_strides.data_ptr(), plan.block_tables.data_ptr(), plan.block_tables.shape[1],
            plan.context_lens.data_ptr(), plan.query_start_loc.data_ptr(), plan.context_lens.shape[0],
            query.shape[1], key_cache.shape[2], query.shape[2], key_cache.shape[1],
            CACHE_TYPES[key_cache.dtype], float(scale) * float(k_scale), float(v_scale),
            int(sliding_window or 0), float(softcap or 0.0),
            None if sink_logits is None else sink_logits.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the CPU attention kernel failed with status {status}")
    if not direct:
        out.copy_(result)
    return out


# attend_and_cache's step array, in the order of cpu_attention.cpp's StepField.
STEP_FIELDS = ("tables", "table_width", "context_lens", "query_start", "num_seqs", "heads", "kv_heads", "head_size",
               "block_size", "cache_type", "key_stride_block", "key_stride_slot", "key_stride_head",
               "value_stride_block", "value_stride_slot", "value_stride_head", "slots", "num_tokens", "elem_bytes",
               "window", "threads")


@dataclass
class StepArgs:
    """A plan bound to one layout of a layer's inputs (cache geometry, query and K/V shapes, dtypes and strides,
    fp8 scales): the step's int64 argument array, the kernel function, and what the checks decided."""

    array: torch.Tensor
    function: object          # the library's attend_and_cache_f32 / _f64
    acc_dtype: torch.dtype
    copies: bool              # the kernel writes the new K/V rows (same dtype as the cache, no scale)
    direct: bool = False      # heads-first inputs the kernel reads in place (attend_heads_first)


def _layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple:
    """Everything the checks of a layer's call depend on (one layer's caches differ from another's only in their
    data): calls with an equal layout reuse the checks and the bound arguments."""
    return (query.shape, query.dtype, key.shape, key.stride(), key.dtype, value.shape, value.stride(), value.dtype,
            key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device, value_cache.shape,
            value_cache.stride(), value_cache.dtype, value_cache.device, k_scale, v_scale)


def _bind_step(plan: CpuPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, k_scale: float, v_scale: float) -> StepArgs:
    """Check a layout once per step and pack the kernel's step array for it."""
    library = load_library("cpu_attention")
    if library is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {build_error('cpu_attention')}")
    if plan.slot_mapping is None:
        raise ValueError("attend_and_cache needs a plan built with the step's slot_mapping")
    _check_inputs(query, key_cache, value_cache, None)
    check_scales(k_scale, v_scale)
    if plan.block_size != key_cache.shape[1] or plan.num_blocks != key_cache.shape[0]:
        raise ValueError("the plan was built for a cache of another shape")
    rows = (plan.num_query_rows, key_cache.shape[2], key_cache.shape[3])
    if query.shape[0] != plan.num_query_rows:
        raise ValueError(f"the query has {query.shape[0]} rows, the step's plan {plan.num_query_rows}")
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != rows:
            raise ValueError(f"{name} must be {list(rows)} (new tokens, KV heads, head size), got {tuple(tensor.shape)}")
    copies = (key.dtype == value.dtype == key_cache.dtype and k_scale == 1.0 and v_scale == 1.0
              and key.stride(-1) == 1 and value.stride(-1) == 1 and key.device.type == value.device.type == "cpu")
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    values = {"tables": plan.block_tables.data_ptr(), "table_width": plan.block_tables.shape[1],
              "context_lens": plan.context_lens.data_ptr(), "query_start": plan.query_start_loc.data_ptr(),
              "num_seqs": plan.context_lens.shape[0], "heads": query.shape[1], "kv_heads": key_cache.shape[2],
              "head_size": query.shape[2], "block_size": key_cache.shape[1], "cache_type": CACHE_TYPES[key_cache.dtype],
              "slots": plan.slot_mapping.data_ptr(), "num_tokens": plan.num_query_rows,
              "elem_bytes": key_cache.element_size(), "window": int(plan.sliding_window or 0),
              "threads": torch.get_num_threads()}
    for prefix, cache in (("key", key_cache), ("value", value_cache)):
        for name, stride in zip(("block", "slot", "head"), cache.stride()[:3]):
            values[f"{prefix}_stride_{name}"] = stride
    array = torch.tensor([values[name] for name in STEP_FIELDS], dtype=torch.int64)
    function = library.attend_and_cache_f64 if acc_dtype == torch.float64 else library.attend_and_cache_f32
    return StepArgs(array, function, acc_dtype, copies)


def attend_and_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, plan: CpuPlan, scale: float, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One attention layer of a step in one kernel call: the new `key`/`value` rows `[num_tokens, kv_heads,
    head_size]` written into the plan's slots, then `paged_attention` over the cache. The step's metadata was
    checked once by the plan (built with its slot_mapping), each layout of a layer's inputs once per step
    (`_layout`); a call checks only its soft-cap and sinks. Rows of another dtype than the cache's (or with fp8
    scales) are written by the PyTorch code (kv_quant), the kernel writes the rest as byte copies."""
    layout = _layout(query, key, value, key_cache, value_cache, k_scale, v_scale)
    step = plan.bound.get(layout)
    if step is None:
        step = plan.bound[layout] = _bind_step(plan, query, key, value, key_cache, value_cache, k_scale, v_scale)
    if not step.copies:
        from .reference import reshape_and_cache

        reshape_and_cache(key, value, key_cache, value_cache, plan.slot_mapping, k_scale, v_scale)
    q = query.to(step.acc_dtype).contiguous()
    out = torch.empty_like(q)
    _launch(step, q, out, q.shape[0], key, value, (key.stride(0), key.stride(1), value.stride(0), value.stride(1)),
            key_cache, value_cache, scale, softcap, sinks, k_scale, v_scale)
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _launch(step: StepArgs, query: torch.Tensor, out: torch.Tensor, num_tokens: int, key: torch.Tensor,
            value: torch.Tensor, row_strides: Tuple[int, int, int, int], key_cache: torch.Tensor,
            value_cache: torch.Tensor, scale: float, softcap: Optional[float], sinks: Optional[torch.Tensor],
            k_scale: float, v_scale: float) -> None:
    """One attend_and_cache kernel call (the new rows written when `step.copies`); `row_strides`: the new K and V
    rows' token and head strides."""
    if softcap is not None or sinks is not None:
        check_attention_variant(query.shape[1], query.device, None, softcap, sinks)   # heads: dim 1 in both layouts
    if not num_tokens:
        return
    sink_logits = None if sinks is None else sinks.to(step.acc_dtype).contiguous()
    status = step.function(
        step.array.data_ptr(), query.data_ptr(), out.data_ptr(), key.data_ptr() if step.copies else None,
        value.data_ptr() if step.copies else None, *row_strides, key_cache.data_ptr(), value_cache.data_ptr(),
        scale * k_scale, v_scale, softcap or 0.0, None if sink_logits is None else sink_logits.data_ptr())
    if status != 0:
        raise RuntimeError(f"the CPU attention kernel failed with status {status}")


def attend_heads_first(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, plan: CpuPlan, scale: float, softcap: Optional[float] = None,
                       sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> Optional[torch.Tensor]:
    """`attend_and_cache` on the layout transformers' attention layers hand over: query `[1, heads, T, D]`, key and
    value `[1, kv_heads, T, D]`, output `[1, T, heads, D]`, with no view or copy per call. It applies when the
    query is of the kernel's dtype (float32 or float64) and its memory is `[T, heads, D]` in order (a query
    projected, viewed per head and transposed, as transformers does; always at one token) and the kernel writes
    the new rows itself; otherwise it returns None and the caller takes `attend_and_cache`. Each layout is checked
    once per step (by `attend_and_cache`'s checks)."""
    layout = ("heads-first", query.shape, query.stride(), query.dtype, key.shape, key.stride(), key.dtype,
              value.shape, value.stride(), value.dtype, key_cache.shape, key_cache.stride(), key_cache.dtype,
              key_cache.device, value_cache.shape, value_cache.stride(), value_cache.dtype, value_cache.device,
              k_scale, v_scale)
    step = plan.bound.get(layout)
    if step is None:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1:
            raise ValueError(f"attend_heads_first takes [1, heads, tokens, head_size] tensors, got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        rows = query[0].transpose(0, 1)
        step = _bind_step(plan, rows, key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
                          k_scale, v_scale)
        step.direct = step.copies and query.dtype == step.acc_dtype and rows.is_contiguous()
        plan.bound[layout] = step
    if not step.direct:
        return None
    out = torch.empty((1, query.shape[2], query.shape[1], query.shape[3]), dtype=query.dtype)
    _launch(step, query, out, query.shape[2], key, value, (key.stride(2), key.stride(1), value.stride(2),
                                                            value.stride(1)),
            key_cache, value_cache, scale, softcap, sinks, k_scale, v_scale)
    return out
