"""Paged attention as one opaque operator for the compiled forward (`torch.ops.paged_backend.attend_layer`).

When `torch.compile` traces the model, each attention layer's call of our attention function becomes this
custom operator: inductor fuses and schedules everything around it but never traces into it, so the kernel
that writes k/v into the paged cache and reads it through the block tables stays ours. On the CPU the operator
is C++ (kernels/cpu_attention_op.cpp): `compiled_attention_step` gives it the step's caches and plans in this
thread around each compiled forward. Calls it does not take (another device, an fp8 cache, a first call for a
window whose plan is not built yet) are `attend_layer_fallback`, implemented here: `attend_step` on the step's
`AttentionMetadata`, read from the calling thread (the metadata changes every step; the graph does not capture
it). The operator's only effect beyond its output is on cache layer `layer`, which no other operator of the graph
touches.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Set, Tuple

import torch

from paged_backend.kernels import cpu_attention_step
from paged_backend.worker.attention import (AttentionMetadata, AttentionOptions, attend_step, checked_options,
                                            current_metadata, describe_module, step_plan)

_PLAIN = AttentionOptions()


def attend_layer_fallback(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                          sliding_window: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """`attend_step` on the thread's current step (window 0 and softcap 0.0 mean none)."""
    metadata = current_metadata()
    if metadata is None:
        raise RuntimeError("the compiled forward ran outside an engine step (no attention metadata in this thread)")
    plain = not sliding_window and not softcap and sinks is None
    options = _PLAIN if plain else AttentionOptions(sliding_window or None, softcap or None, sinks)
    return attend_step(query, key, value, layer, scaling, options, metadata)


cpu_attention_step.define_ops()
_library = torch.library.Library("paged_backend", "IMPL")
_library.impl("attend_layer_fallback", attend_layer_fallback, "CompositeExplicitAutograd")


@contextmanager
def compiled_attention_step(metadata: Optional[AttentionMetadata], windows: Set[Optional[int]]) -> Iterator[bool]:
    """Around one compiled forward: the C++ operator gets the step's caches (unless a cache has fp8 scales) and
    its plans for `windows` (the sliding windows earlier steps used; None: no window), built here; a window
    met for the first time takes the fallback once and is added to `windows` after the forward. Yields whether
    the operator got the step."""
    usable = metadata is not None and (metadata.kv_scales is None or
                                       all(scales == (1.0, 1.0) for scales in metadata.kv_scales))
    with cpu_attention_step.attention_step(metadata.kv_caches if usable else None) as active:
        if active:
            for window, plan in metadata.plans.items():   # built before the forward
                cpu_attention_step.set_plan(window, plan)
            for window in windows - metadata.plans.keys():   # step_plan gives the operator each plan it builds
                step_plan(metadata, window, metadata.kv_caches[0][0])
        yield active
        if active:
            windows.update(metadata.plans)


def traced_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float], dropout: Any,
                     kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, None]:
    """What our attention function does while dynamo traces it: the step-independent checks, then the op."""
    options = checked_options(module, query, attention_mask, dropout, kwargs)
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{describe_module(module)}: an attention module without an integer layer_idx cannot be "
                         f"compiled")
    scale = float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5
    out = torch.ops.paged_backend.attend_layer(query, key, value, layer, scale, options.sliding_window or 0,
                                               options.softcap or 0.0, options.sinks)
    return out, None
