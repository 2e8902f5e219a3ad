"""PEFT adapters on an attached model (`load_adapter`, `set_adapter`, `PeftModel`): the model's own PEFT layers
apply the active adapter in every forward, exactly as transformers' `generate` runs them. What the engine must
know is *which* adapter state a call runs with, so that KV blocks computed under one adapter are never reused
under another: `adapter_cache_salt(model)` names it (the prefix cache keeps salted requests apart).
"""

from __future__ import annotations

import hashlib
from typing import Dict, Optional, Tuple

import torch

_DIGESTS: Dict[Tuple[int, int, int], bytes] = {}   # (id, version, data_ptr) of a weight -> digest of its bytes


def _digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 of a weight's values, cached while the tensor is the same object, unmodified, at the same place."""
    key = (id(tensor), tensor._version, tensor.data_ptr())
    digest = _DIGESTS.get(key)
    if digest is None:
        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha256(data).digest()
        if len(_DIGESTS) > 4096:
            _DIGESTS.clear()
        _DIGESTS[key] = digest
    return digest


def _tuner_layers(model: torch.nn.Module):
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapters
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def _layer_state(name: str, layer) -> Optional[str]:
    """The part of a PEFT layer that changes its output: active adapters (their weights and scalings) and
    adapters merged into the base weights; None when it computes what the base layer computes."""
    merged = list(getattr(layer, "merged_adapters", []) or [])
    active = [] if getattr(layer, "disable_adapters", False) else list(getattr(layer, "active_adapters", []) or [])
    if not merged and not active:
        return None
    digest = hashlib.sha256()
    for adapter in sorted(set(active) | set(merged)):
        for attribute in getattr(layer, "adapter_layer_names", ()):
            holder = getattr(layer, attribute, None)
            if holder is not None and adapter in holder:
                entry = holder[adapter]
                tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry.parameters())
                for tensor in tensors:
                    digest.update(_digest(tensor))
        for attribute in getattr(layer, "other_param_names", ()):
            holder = getattr(layer, attribute, None)
            if isinstance(holder, dict) and adapter in holder:
                digest.update(repr(holder[adapter]).encode())
    return f"{name}|active={active}|merged={merged}|{digest.hexdigest()}"


def adapter_cache_salt(model: torch.nn.Module) -> Optional[str]:
    """A name for the PEFT adapter state of `model` (None without adapters, or with all of them disabled): the
    same active adapters with the same weights give the same salt."""
    states = [state for name, layer in _tuner_layers(model) if (state := _layer_state(name, layer)) is not None]
    if not states:
        return None
    return "peft:" + hashlib.sha256("\n".join(states).encode()).hexdigest()
