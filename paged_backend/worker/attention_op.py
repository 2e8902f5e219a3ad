"""Paged attention as one opaque operator (`torch.ops.paged_backend.attend_step`) for the compiled forward.

When `torch.compile` traces the model, each attention layer's call of our attention function becomes this
custom operator: inductor fuses and schedules everything around it but never traces into it, so the kernel
that writes k/v into the paged cache and reads it through the block tables stays ours. The operator reads the
step's `AttentionMetadata` from the calling thread when it runs (the metadata changes every step; the compiled
graph does not capture it), and its only effect beyond its output is on cache layer `layer`, which no other
operator of the graph touches.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from paged_backend.worker.attention import (AttentionOptions, attend_step, checked_options, current_metadata,
                                            describe_module)


# A plain `torch.library.Library` operator rather than `torch.library.custom_op`: the compiled graph calls it 30
# times per decode step, and custom_op's Python wrappers (autograd, schema checks) cost 8 us more per call.
_library = torch.library.Library("paged_backend", "DEF")
_library.define("attend_step(Tensor query, Tensor key, Tensor value, int layer, float scaling, int sliding_window, "
                "float softcap, Tensor? sinks) -> Tensor")
_PLAIN = AttentionOptions()


def attend_step_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                   sliding_window: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """`attend_step` on the thread's current step (window 0 and softcap 0.0 mean none)."""
    metadata = current_metadata()
    if metadata is None:
        raise RuntimeError("the compiled forward ran outside an engine step (no attention metadata in this thread)")
    plain = not sliding_window and not softcap and sinks is None
    options = _PLAIN if plain else AttentionOptions(sliding_window or None, softcap or None, sinks)
    return attend_step(query, key, value, layer, scaling, options, metadata)


_library.impl("attend_step", attend_step_op, "CompositeExplicitAutograd")


@torch.library.register_fake("paged_backend::attend_step")
def _attend_step_shape(query, key, value, layer, scaling, sliding_window, softcap, sinks):
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


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
    out = torch.ops.paged_backend.attend_step(query, key, value, layer, scale, options.sliding_window or 0,
                                              options.softcap or 0.0, options.sinks)
    return out, None
