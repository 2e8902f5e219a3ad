"""The attention function that unmodified Hugging Face models call while the engine runs a step.

The model runner registers `paged_attention_forward` with transformers' `AttentionInterface` under
`ATTENTION_NAME` and sets the step's `AttentionMetadata` around the forward. Each attention layer
then hands us its projected (and rotary-embedded) q/k/v for the packed step; we write k/v into the
paged cache and attend through the block tables. Outside a step (no metadata in this thread) the
function falls back to SDPA, so a model used directly keeps working.

The keywords a model passes are read strictly (`attention_options`): a sliding window, a logit
soft-cap and sinks (`s_aux`) are applied; keywords that do not change attention are ignored; any other
keyword with a non-default value is refused with a ValueError, so a feature of a future transformers
release is never dropped silently.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from paged_backend import kernels
from paged_backend.kernels import cpu_attention_step

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
    kv_scales: Optional[List[Tuple[float, float]]] = None   # per layer (K, V) scales of an fp8 cache
    plans: Dict[Optional[int], Optional[kernels.Plan]] = field(default_factory=dict)   # by sliding window


# Keywords transformers' attention functions receive (transformers 5.x) and how we treat them.
APPLIED_KEYWORDS = frozenset({"sliding_window", "softcap", "s_aux"})
# Consumed before attention (RoPE used position_ids already) or not about attention at all.
NO_EFFECT_KEYWORDS = frozenset({"position_ids", "use_cache", "output_hidden_states", "output_router_logits",
                                "num_items_in_batch"})
# Accepted only at these default values; every other keyword must be None.
DEFAULT_ONLY_KEYWORDS = {"is_causal": (None, True), "output_attentions": (None, False)}

_model_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def name_attention_modules(model: torch.nn.Module) -> None:
    """Remember the model class of every module of `model`, for error messages raised inside attention."""
    name = type(model).__name__
    for module in model.modules():
        _model_names[module] = name


@dataclass(frozen=True)
class AttentionOptions:
    """What one attention call asks for beyond causal attention (see kernels/variant.py)."""

    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None   # [num_heads] logits (transformers' s_aux)


def describe_module(module: torch.nn.Module) -> str:
    """"Model class (attention class of layer N)", for error messages."""
    model = _model_names.get(module)
    layer = getattr(module, "layer_idx", None)
    where = f"{type(module).__name__}" + (f" of layer {layer}" if layer is not None else "")
    return f"{model} ({where})" if model else where


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_default(name: str, value: Any) -> bool:
    return any(value is default for default in DEFAULT_ONLY_KEYWORDS.get(name, (None,)))


def attention_options(module: torch.nn.Module, dropout: Any, kwargs: Dict[str, Any]) -> AttentionOptions:
    """The variant an attention call asks for; ValueError naming the model class and the keyword for
    anything the paged backend does not implement."""
    if dropout not in (None, 0, 0.0):
        raise ValueError(f"{describe_module(module)}: attention dropout={_short(dropout)} is not implemented by "
                         f"the paged backend (the engine runs models in eval mode)")
    for name, value in kwargs.items():
        if name in APPLIED_KEYWORDS or name in NO_EFFECT_KEYWORDS or _is_default(name, value):
            continue
        raise ValueError(f"{describe_module(module)}: the attention keyword {name}={_short(value)} is not "
                         f"implemented by the paged backend; refusing rather than ignoring it")
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{describe_module(module)}: sliding_window must be a positive int, got {_short(window)}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"{describe_module(module)}: softcap must be a positive number, got {_short(softcap)}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1):
        raise ValueError(f"{describe_module(module)}: s_aux must be a tensor [num_heads], got {_short(sinks)}")
    return AttentionOptions(window, None if softcap is None else float(softcap), sinks)


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
    if torch.compiler.is_dynamo_compiling():   # traced by the compiled forward: the kernel is one opaque op
        from paged_backend.worker.attention_op import traced_attention

        return traced_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    metadata = current_metadata()
    if metadata is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if kwargs.get("s_aux") is not None:   # SDPA would ignore the sinks (it refuses softcap itself)
            raise ValueError(f"{describe_module(module)}: outside an engine step this attention function falls "
                             f"back to SDPA, which cannot apply attention sinks (s_aux)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    options = checked_options(module, query, attention_mask, dropout, kwargs)
    out = attend_step(query, key, value, _layer_index(module, metadata), scaling, options, metadata)
    return out, None


def checked_options(module: torch.nn.Module, query: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    dropout: Any, kwargs: Dict[str, Any]) -> AttentionOptions:
    """The call's options, after the checks that do not depend on the step (traceable: no metadata read)."""
    options = attention_options(module, dropout, kwargs)
    if attention_mask is not None:
        raise ValueError(f"{describe_module(module)}: the model passed its own attention mask; the paged backend "
                         f"applies causal (and sliding-window) masking itself and cannot reproduce other masks")
    if query.shape[0] != 1:
        raise RuntimeError("the paged attention path expects the step packed as one row")
    if options.sinks is not None and options.sinks.shape[0] != query.shape[1]:
        raise ValueError(f"{describe_module(module)}: s_aux has {options.sinks.shape[0]} sinks for {query.shape[1]} "
                         f"query heads (sinks are not sharded over tensor-parallel ranks)")
    return options


def attend_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: Optional[float],
                options: AttentionOptions, metadata: AttentionMetadata) -> torch.Tensor:
    """Write the step's k/v of cache layer `layer` and attend through the block tables: `[1, T, H, D]`."""
    key_cache, value_cache = metadata.kv_caches[layer]
    k_scale, v_scale = metadata.kv_scales[layer] if metadata.kv_scales is not None else (1.0, 1.0)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    window = options.sliding_window
    plan = step_plan(metadata, window, key_cache)
    out = kernels.attend_heads_first(query, key, value, key_cache, value_cache, plan, scaling, window,
                                     options.softcap, options.sinks, k_scale, v_scale)
    if out is not None:
        return out
    q = query[0].transpose(0, 1)
    out = kernels.attend_and_cache(q, key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
                                   metadata.slot_mapping, metadata.block_tables, metadata.context_lens,
                                   metadata.query_start_loc, scaling, plan=plan, sliding_window=window,
                                   softcap=options.softcap, sinks=options.sinks, k_scale=k_scale, v_scale=v_scale)
    return out.unsqueeze(0)


_NO_PLAN = object()   # no plan yet for a window (Triton's plan is None)


def step_plan(metadata: AttentionMetadata, window: Optional[int], key_cache: torch.Tensor) -> Optional[kernels.Plan]:
    """The step's attention plan for `window` (None: no window), built and checked on first use, once for all
    layers (and given to the C++ operator when a compiled forward runs: attention_op.py)."""
    plan = metadata.plans.get(window, _NO_PLAN)
    if plan is _NO_PLAN:
        plan = metadata.plans[window] = kernels.plan_attention(
            key_cache, metadata.block_tables, metadata.context_lens, metadata.query_start_loc, window,
            metadata.slot_mapping)
        cpu_attention_step.set_plan(window, plan)
    return plan


def paged_attention_mask(*args, **kwargs):
    """No dense mask during a step: causality and sequence boundaries come from the metadata (the compiled
    forward is traced only for steps)."""
    if not torch.compiler.is_dynamo_compiling() and current_metadata() is None:
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
