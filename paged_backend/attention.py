"""The attention function that unmodified Hugging Face models call while the engine runs a step.

The model runner registers `paged_attention_forward` with transformers' `AttentionInterface` under
`ATTENTION_NAME` and sets the step's `AttentionMetadata` around the forward. Each attention layer
then hands us its projected (and rotary-embedded) q/k/v for the packed step; we write k/v into the
paged cache and attend through the block tables. Outside a step (no metadata in this thread) the
function falls back to SDPA, so a model used directly keeps working.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from . import kernels

ATTENTION_NAME = "paged_backend"
_local = threading.local()


@dataclass
class AttentionMetadata:
    """Per-step inputs of the attention layers (all tensors on the model's device)."""

    slot_mapping: torch.Tensor     # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor     # [num_seqs] tokens each sequence attends to (cached + new)
    query_start_loc: torch.Tensor  # [num_seqs + 1] first row of each sequence's new tokens
    block_size: int
    kv_caches: List[Tuple[torch.Tensor, torch.Tensor]]
    layer_of: Dict[int, int]       # id(attention module) -> cache layer
    plan: Optional[kernels.AttentionPlan] = None


def current_metadata() -> Optional[AttentionMetadata]:
    return getattr(_local, "metadata", None)


@contextmanager
def attention_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make `metadata` visible to the attention layers of forwards run by this thread."""
    previous = current_metadata()
    _local.metadata = metadata
    try:
        yield
    finally:
        _local.metadata = previous


def _layer_index(module: torch.nn.Module, metadata: AttentionMetadata) -> int:
    layer = metadata.layer_of.get(id(module))
    if layer is None:
        layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"attention module {type(module).__name__} has no layer index")
    return layer


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                            dropout: float = 0.0, **kwargs):
    """transformers attention interface: q `[1, H, T, D]`, k/v `[1, KVH, T, D]` -> `[1, T, H, D]`."""
    metadata = current_metadata()
    if metadata is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise RuntimeError("the paged attention path expects the step packed as one row")
    key_cache, value_cache = metadata.kv_caches[_layer_index(module, metadata)]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kernels.reshape_and_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if metadata.plan is None and kernels.kernel_backend(key_cache) == "torch":
        metadata.plan = kernels.plan_paged_attention(metadata.block_tables, metadata.context_lens,
                                                     metadata.query_start_loc, metadata.block_size)
    out = kernels.paged_attention(q.contiguous(), key_cache, value_cache, metadata.block_tables,
                                  metadata.context_lens, metadata.query_start_loc, scaling, plan=metadata.plan)
    return out.unsqueeze(0), None


def paged_attention_mask(*args, **kwargs):
    """No dense mask during a step: causality and sequence boundaries come from the metadata."""
    if current_metadata() is None:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, **kwargs)
    return None


_registered = False


def register_attention() -> None:
    """Register the attention function and its mask function with transformers (once)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_attention_mask)
    _registered = True
