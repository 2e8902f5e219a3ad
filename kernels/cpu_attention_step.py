"""Paged attention as the operator `torch.ops.paged_backend.attend_layer`, which compiled forwards call once per
attention layer: a C++ CPU kernel (`cpu_attention_op.cpp`) for the calls it takes, `attend_layer_fallback` (whoever
runs steps implements it: worker/attention_op.py) for the rest.

The step's metadata is not an argument (the compiled graph does not capture it): `attention_step(...)` sets the
layers' caches in this thread for one forward, and `set_plan` adds each sliding window's `CpuPlan` (built and
checked by `plan_paged_attention`) when the step first meets it; the C++ side checks every plan against the
caches again before it keeps it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import torch

from .cpu import CpuPlan
from .cpu_build import load_torch_ops

_operators: list = []   # the torch.library.Library defining the schemas, kept alive
_local = threading.local()

SIGNATURE = ("(Tensor query, Tensor key, Tensor value, int layer, float scaling, int sliding_window, float softcap, "
             "Tensor? sinks) -> Tensor")


def define_ops() -> None:
    """Define, once: `attend_layer` and `attend_layer_fallback` (query `[1, heads, T, D]`, new key/value `[1,
    kv_heads, T, D]` -> `[1, T, heads, D]`; window 0 and softcap 0.0 mean none), the step's setters
    (`set_attention_caches`, `set_attention_plan`, `clear_attention_step`, `attention_step_set`) and
    `attend_layer_kernel_calls()` (how often the C++ kernel ran in this process)."""
    if _operators:
        return
    library = torch.library.Library("paged_backend", "FRAGMENT")
    library.define("attend_layer" + SIGNATURE)
    library.define("attend_layer_fallback" + SIGNATURE)
    library.define("set_attention_caches(Tensor[] key_caches, Tensor[] value_caches) -> bool")
    library.define("set_attention_plan(int window, Tensor tables, Tensor context_lens, Tensor query_start, "
                   "Tensor slots) -> ()")
    library.define("clear_attention_step() -> ()")
    library.define("attention_step_set() -> bool")
    library.define("attend_layer_kernel_calls() -> int")
    # where the C++ library is not loaded (or for tensors off the CPU), every call is the fallback
    library.impl("attend_layer", _fallback, "CompositeExplicitAutograd")
    for name in ("attend_layer", "attend_layer_fallback"):
        torch.library.register_fake(f"paged_backend::{name}", _output_shape, lib=library)
    _operators.append(library)


def _fallback(query, key, value, layer, scaling, sliding_window, softcap, sinks):
    return torch.ops.paged_backend.attend_layer_fallback(query, key, value, layer, scaling, sliding_window, softcap,
                                                         sinks)


def _output_shape(query, key, value, layer, scaling, sliding_window, softcap, sinks):
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def op_available() -> bool:
    """Whether `attend_layer` has its C++ kernel (built and loaded on first call, about 10 s once per machine
    and torch version; False when it cannot be built, the reason logged once)."""
    define_ops()
    return load_torch_ops("cpu_attention_op")


def kernel_calls() -> int:
    """How many `attend_layer` calls ran the C++ kernel in this process (0 without it)."""
    return int(torch.ops.paged_backend.attend_layer_kernel_calls()) if op_available() else 0


@contextmanager
def attention_step(kv_caches: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]) -> Iterator[bool]:
    """Set the layers' caches for the C++ kernel in this thread while the block runs (None, caches it cannot
    take: not all CPU tensors of one number of blocks and block size; another kernel backend than `cpp`, as
    `PAGED_BACKEND_KERNELS=torch` asks; no C++ library: every call is the fallback); yields whether they were
    set."""
    from . import kernel_backend

    active = (bool(kv_caches) and kernel_backend(kv_caches[0][0]) == "cpp" and op_available() and
              torch.ops.paged_backend.set_attention_caches([k for k, _ in kv_caches], [v for _, v in kv_caches]))
    if not active:
        yield False
        return
    _local.active = True
    try:
        yield True
    finally:
        _local.active = False
        torch.ops.paged_backend.clear_attention_step()


def set_plan(window: Optional[int], plan) -> None:
    """Give the C++ kernel the step's checked `CpuPlan` for `window` (None: no window), inside `attention_step`;
    a no-op elsewhere, or for a plan without slots (which the kernel could not write through)."""
    if getattr(_local, "active", False) and isinstance(plan, CpuPlan) and plan.slot_mapping is not None:
        torch.ops.paged_backend.set_attention_plan(int(window or 0), plan.block_tables, plan.context_lens,
                                                   plan.query_start_loc, plan.slot_mapping)
