"""Where a Triton model instance runs and how much memory it may take.

`KIND_GPU` instances run on the GPU Triton gives them (`model_instance_device_id`), `KIND_CPU` instances on
the host, `KIND_MODEL` instances where `model.json` says (`device`, by default `auto`: the first GPU if
there is one). Instances that share a device share its memory: `gpu_memory_utilization` is divided among
them, and without any sizing option each gets an equal part of the default: vLLM's 0.9 of a GPU, and on the
host the engine's default (a quarter of the host's memory, at most 4 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from paged_backend import total_memory

from .model_json import ModelOptions

VLLM_DEFAULT_UTILIZATION = 0.9
_SIZING = ("num_blocks", "kv_cache_memory", "gpu_memory_utilization")
_GIB = 2 ** 30


@dataclass
class Placement:
    """The device of one instance and how many instances of the model share that device."""

    device: str
    sharing: int = 1


def _groups(model_config: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(model_config.get("instance_group") or [{"kind": "KIND_GPU" if torch.cuda.is_available()
                                                        else "KIND_CPU", "count": 1}])


def _sharing(model_config: Dict[str, Any], kind: str, device_id: int) -> int:
    """Instances of this model on the same device as this one."""
    total = 0
    for group in _groups(model_config):
        group_kind = str(group.get("kind", "KIND_GPU")).removeprefix("KIND_")
        count = int(group.get("count", 1) or 1)
        if kind == "GPU" and group_kind == "GPU":
            gpus = [int(g) for g in group.get("gpus") or []]
            total += count if not gpus or device_id in gpus else 0
        elif kind != "GPU" and group_kind == kind:
            total += count
    return max(total, 1)


def place(options: ModelOptions, kind: str, device_id: int, model_config: Dict[str, Any]) -> Placement:
    """The instance's device; a ValueError when model.json and the instance group disagree."""
    kind = kind.upper().removeprefix("KIND_")
    wanted = options.device
    tensor_parallel = options.engine.get("tensor_parallel_size", 1) > 1
    if kind == "GPU":
        if tensor_parallel:
            raise ValueError("KIND_GPU instances use one GPU each; for tensor_parallel_size > 1 use KIND_MODEL "
                             "in config.pbtxt (as Triton's vLLM backend requires)")
        if wanted not in ("auto", "cuda", f"cuda:{device_id}"):
            raise ValueError(f"model.json asks for device {wanted!r} but the instance is KIND_GPU on GPU {device_id}")
        device = f"cuda:{device_id}"
    elif kind == "CPU":
        if wanted not in ("auto", "cpu"):
            raise ValueError(f"model.json asks for device {wanted!r} but the instance is KIND_CPU; use KIND_GPU or "
                             f"KIND_MODEL in config.pbtxt")
        device = "cpu"
    else:
        device = wanted if wanted != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return Placement(device, _sharing(model_config, kind, device_id))


def engine_kwargs(options: ModelOptions, placement: Placement) -> Dict[str, Any]:
    """Keyword arguments for `AsyncLLMEngine(options.model, **kwargs)` for this instance."""
    engine = dict(options.engine)
    share = placement.sharing
    on_gpu = torch.device(placement.device).type == "cuda"
    if engine.get("gpu_memory_utilization") is not None:
        engine["gpu_memory_utilization"] = engine["gpu_memory_utilization"] / share
    elif not any(engine.get(k) is not None for k in _SIZING):
        if on_gpu:
            engine["gpu_memory_utilization"] = VLLM_DEFAULT_UTILIZATION / share
        elif share > 1:
            engine["kv_cache_memory"] = min(total_memory(torch.device("cpu")) // 4, 4 * _GIB) // share
    return dict(dtype=options.dtype, device=placement.device, trust_remote_code=options.trust_remote_code, **engine)
