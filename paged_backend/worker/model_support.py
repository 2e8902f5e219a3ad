"""Which models the engine can run exactly, decided at construction, and what attention each layer uses.

Static checks read the config (encoder-decoder, bidirectional or chunked attention, layer kinds other
than full and sliding attention, cross-attention). Then `probe_attention` runs one short forward of the
model with a recording attention function: every layer must call transformers' attention interface
exactly once, with keywords the paged backend implements (see attention.py), with the KV shape of the
cache, and with a mask whose pattern is the one the engine applies: causal, and `kv > q - W` for a layer
that passes `sliding_window=W`. The mask pattern is checked by evaluating transformers' own mask function
for that layer at positions up to the model's context length, so chunked, bidirectional, prefix-LM or
image-token masks are refused even when a short probe could not tell them apart.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from paged_backend.worker.attention import attention_options, describe_module, name_attention_modules
from paged_backend.worker.trace_exclusion import TRACE_EXCLUSION

PROBE_NAME = "paged_backend_probe"
PROBE_TOKENS = 4
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerAttention:
    """The attention kind of one layer, as the model asks for it at each call."""

    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False

    def describe(self) -> str:
        parts = [f"window {self.sliding_window}" if self.sliding_window is not None else "full"]
        if self.softcap is not None:
            parts.append(f"soft-cap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return ", ".join(parts)


@dataclass
class _ProbeCall:
    layer: int
    module: torch.nn.Module
    kind: LayerAttention
    num_heads: int
    num_kv_heads: int
    head_size: int
    mask: Any                       # the tensor the layer received (None: no mask)


Masks = Dict[int, Tuple[torch.Tensor, Callable]]   # id(mask tensor) -> (the tensor, its pattern function)
_probed: "weakref.WeakKeyDictionary[torch.nn.Module, List[LayerAttention]]" = weakref.WeakKeyDictionary()


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _refuse(model: torch.nn.Module, why: str) -> ValueError:
    return ValueError(f"{type(model).__name__} is not supported: {why}")


def _check_config(model: torch.nn.Module) -> None:
    """Refusals that the config alone decides."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        raise ValueError(f"{type(model).__name__} is not a Hugging Face causal language model")
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; only decoder-only models are supported")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{name} does not support transformers' attention backend interface "
                         f"(_supports_attention_backend is False), so its attention cannot be paged")
    text = _text_config(config)
    for cfg in {id(config): config, id(text): text}.values():
        if getattr(cfg, "is_causal", True) is False or getattr(cfg, "use_bidirectional_attention", False):
            raise _refuse(model, "its attention is bidirectional (not causal)")
        if getattr(cfg, "add_cross_attention", False):
            raise _refuse(model, "it has cross-attention layers")
        if getattr(cfg, "attention_chunk_size", None):
            raise _refuse(model, f"it uses chunked attention (attention_chunk_size={cfg.attention_chunk_size})")
    kinds = sorted(set(getattr(text, "layer_types", None) or []) - set(SUPPORTED_LAYER_TYPES))
    if kinds:
        raise _refuse(model, f"it has layers of type {', '.join(kinds)}; the paged backend implements "
                             f"{' and '.join(SUPPORTED_LAYER_TYPES)} only")


# ---- the probe forward -----------------------------------------------------------------------------
@dataclass
class _ProbeRecord:
    """What one probe forward saw: the attention calls and the masks transformers built."""

    calls: List[_ProbeCall] = field(default_factory=list)
    masks: Masks = field(default_factory=dict)


_probe_local = threading.local()   # the running probe's record (registrations are global, records per thread)


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Records the layer's call (validating its keywords) and returns zeros of the right shape."""
    options = attention_options(module, dropout, kwargs)
    if options.sinks is not None and options.sinks.shape[0] != query.shape[1]:
        raise ValueError(f"{describe_module(module)}: s_aux has {options.sinks.shape[0]} sinks for {query.shape[1]} "
                         f"query heads (sinks are not sharded over tensor-parallel ranks)")
    layer = getattr(module, "layer_idx", None)
    kind = LayerAttention(options.sliding_window, options.softcap, options.sinks is not None)
    _probe_local.record.calls.append(_ProbeCall(layer if isinstance(layer, int) else -1, module, kind,
                                                query.shape[1], key.shape[1], key.shape[-1], attention_mask))
    return torch.zeros_like(query).transpose(1, 2).contiguous(), None


def _probe_mask(*args, **kwargs):
    """Builds the real boolean mask (no skipping) and remembers which pattern function made it (the
    record keeps each mask alive, so ids stay unique)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    mask = sdpa_mask(*args, **kwargs)
    if mask is None:
        mask = torch.ones(1, dtype=torch.bool)
    _probe_local.record.masks[id(mask)] = (mask, kwargs.get("mask_function", causal_mask_function))
    return mask


class _NoCommunication:
    """Stands in for the process group when probing one tensor-parallel shard (the outputs are unused)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None


@contextmanager
def _probe_backend(model: torch.nn.Module, record: _ProbeRecord) -> Iterator[None]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from paged_backend.worker.tp_sharding import tensor_parallel_context

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = PROBE_NAME
    _probe_local.record = record
    try:
        with tensor_parallel_context(_NoCommunication()):
            yield
    finally:
        config._attn_implementation = previous
        _probe_local.record = None


def _run_probe(model: torch.nn.Module) -> _ProbeRecord:
    record = _ProbeRecord()
    device = next(model.parameters()).device
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device)[None]
    with torch.inference_mode(), _probe_backend(model, record), TRACE_EXCLUSION.forward():
        try:
            model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=device)[None], use_cache=False)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure means the model cannot run paged
            raise _refuse(model, f"a probe forward with transformers' attention interface failed: "
                                 f"{type(error).__name__}: {error}") from error
    return record


# ---- checking the probe -----------------------------------------------------------------------------
def _probe_points(horizon: int, windows: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, kv) position pairs around every window edge and the diagonal, plus random pairs up to `horizon`."""
    gen = torch.Generator().manual_seed(0)
    qs = [0, 1, 2, 3, horizon - 1] + torch.randint(0, horizon, (256,), generator=gen).tolist()
    for w in windows:
        qs += [w - 1, w, w + 1, 2 * w, 2 * w + 1]
    pairs = []
    for q in qs:
        kvs = [0, q - 1, q, q + 1, q + 2, int(torch.randint(0, q + 1, (1,), generator=gen))]
        for w in windows:
            kvs += [q - w - 1, q - w, q - w + 1]
        pairs += [(q, kv) for kv in kvs if 0 <= kv < horizon and 0 <= q < horizon]
    pairs = sorted(set(pairs))
    return torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])


def _check_mask(model: torch.nn.Module, call: _ProbeCall, masks: Masks, horizon: int) -> None:
    where = f"layer {call.layer} ({type(call.module).__name__})"
    if call.mask is None:
        if getattr(call.module, "is_causal", True) is False:
            raise _refuse(model, f"{where} is not causal (is_causal=False)")
        return
    entry = masks.get(id(call.mask)) or masks.get(id(getattr(call.mask, "_base", None)))   # a slice is fine
    if entry is None:
        raise _refuse(model, f"{where} receives an attention mask the model built itself, which the paged backend "
                             f"cannot reproduce")
    function = entry[1]
    window = call.kind.sliding_window
    q, kv = _probe_points(horizon, [window] if window else [])
    zeros = torch.zeros_like(q)
    try:
        got = torch.as_tensor(function(zeros, zeros, q, kv)).to(torch.bool).expand(q.shape)
    except Exception as error:  # noqa: BLE001
        raise _refuse(model, f"{where}: its attention mask pattern could not be evaluated "
                             f"({type(error).__name__}: {error})") from error
    want = kv <= q
    if window is not None:
        want &= kv > q - window
    wrong = (got != want).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        raise _refuse(model, f"{where} masks query {int(q[i])} / key {int(kv[i])} as "
                             f"{'visible' if bool(got[i]) else 'hidden'}, but the paged backend applies causal "
                             f"attention{f' with a window of {window}' if window else ''} (its mask is not causal "
                             f"or uses a pattern such as chunked, bidirectional or prefix attention)")


def _check_calls(model: torch.nn.Module, calls: List[_ProbeCall], masks: Masks) -> List[LayerAttention]:
    from paged_backend.worker.cache_engine import kv_geometry

    geometry = kv_geometry(model.config)
    text = _text_config(model.config)
    by_layer: Dict[int, _ProbeCall] = {}
    for call in calls:
        if call.layer in by_layer or call.layer < 0:
            raise _refuse(model, f"{type(call.module).__name__} calls attention more than once per layer or has "
                                 f"no layer index")
        by_layer[call.layer] = call
    missing = sorted(set(range(geometry.num_layers)) - set(by_layer))
    if missing or len(by_layer) != geometry.num_layers:
        raise _refuse(model, f"layers {missing or sorted(by_layer)} do not run attention through transformers' "
                             f"attention interface (recurrent, linear or other non-attention layers)")
    horizon = max(64, int(getattr(text, "max_position_embeddings", 0) or 0))
    for call in calls:
        if call.kind.sliding_window:
            horizon = max(horizon, 4 * call.kind.sliding_window)
    horizon = min(horizon, 1 << 22)
    kv_heads = by_layer[0].num_kv_heads   # this shard's count under tensor parallelism
    for layer in range(geometry.num_layers):
        call = by_layer[layer]
        if call.head_size != geometry.head_size or call.num_kv_heads != kv_heads or kv_heads > geometry.num_kv_heads:
            raise _refuse(model, f"layer {layer} has {call.num_kv_heads} KV heads of size {call.head_size}, but the "
                                 f"KV cache holds {geometry.num_kv_heads} of size {geometry.head_size} for every layer")
        _check_mask(model, call, masks, horizon)
    return [by_layer[layer].kind for layer in range(geometry.num_layers)]


def probe_attention(model: torch.nn.Module) -> List[LayerAttention]:
    """Each layer's attention kind, after checking that the paged backend reproduces it (ValueError if not)."""
    cached = _probed.get(model)
    if cached is not None:
        return cached
    record = _run_probe(model)
    kinds = _check_calls(model, record.calls, record.masks)
    _probed[model] = kinds
    return kinds


def check_model_supported(model: torch.nn.Module) -> None:
    """Refuse, naming the model class, any model whose attention the engine cannot reproduce exactly."""
    _check_config(model)
    name_attention_modules(model)
    probe_attention(model)


def uniform_window(model: torch.nn.Module) -> Optional[int]:
    """The largest window when every layer attends through a sliding window (the keys any layer can still
    read); None when some layer attends to the whole context."""
    windows = [kind.sliding_window for kind in probe_attention(model)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def attention_groups(model: torch.nn.Module) -> List[Tuple[LayerAttention, List[int]]]:
    """Layers grouped by attention kind, in order of first appearance."""
    groups: Dict[LayerAttention, List[int]] = {}
    for layer, kind in enumerate(probe_attention(model)):
        groups.setdefault(kind, []).append(layer)
    return list(groups.items())


def describe_attention(model: torch.nn.Module) -> List[str]:
    """One line per layer group, e.g. "layers 0, 2, 4 (3 of 6): window 4096, soft-cap 50"."""
    total = sum(len(layers) for _, layers in attention_groups(model))
    lines = []
    for kind, layers in attention_groups(model):
        label = "layer" if len(layers) == 1 else "layers"
        lines.append(f"{label} {_ranges(layers)} ({len(layers)} of {total}): {kind.describe()}")
    return lines


def _ranges(layers: List[int]) -> str:
    """[0, 1, 2, 5, 7, 9] -> "0-2, 5, 7, 9"; long alternating lists stay readable."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(parts) if len(parts) <= 8 else ", ".join(parts[:6]) + f", ... {parts[-1]}"
