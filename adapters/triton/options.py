"""Engine options of a Triton model (`<model>/1/model.json`): reading, validating, and engine kwargs.

The file holds the model (a preset name or a local Hugging Face directory) and the engine options
(`dtype`, `block_size`, `kv_cache_memory` or `num_blocks`, `max_num_seqs`, `preemption_mode`,
`enable_prefix_caching`, ...). Values may be strings, as in vLLM-backend `model.json` files. Anything
invalid raises a ValueError that names the option, which fails the model's loading in Triton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from paged_backend.config import EngineConfig, parse_memory

from .coerce import to_bool, to_float, to_int, to_str

MODEL_JSON = "model.json"
DTYPES = ("float32", "float16", "bfloat16", "float64")
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "fp64": "float64", "double": "float64", "float": "float32", "auto": "float32"}


def _optional(read: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else read(name, value)


def _memory(name: str, value: Any) -> Union[int, None]:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return parse_memory(value, name)


def _preemption(name: str, value: Any) -> Optional[str]:
    if value in ("recompute", "swap"):
        return value
    raise ValueError(f"{name} must be 'recompute' or 'swap' (or null for the engine's choice), got {value!r}")


def _dtype(name: str, value: Any) -> str:
    text = _DTYPE_ALIASES.get(str(value).strip().lower(), str(value).strip().lower())
    if text.startswith("torch."):
        text = text[len("torch."):]
    if text not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return text


# option -> reader; every engine option of EngineConfig plus the model, dtype and device.
_READERS: Dict[str, Callable[[str, Any], Any]] = {
    "model": to_str, "dtype": _dtype, "device": to_str,
    "block_size": to_int, "num_blocks": _optional(to_int), "kv_cache_memory": _optional(_memory),
    "num_swap_blocks": _optional(to_int), "swap_space": _optional(_memory),
    "max_num_seqs": to_int, "max_num_batched_tokens": to_int, "max_model_len": _optional(to_int),
    "preemption_mode": _optional(_preemption), "enable_prefix_caching": to_bool,
    "tensor_parallel_size": to_int, "seed": to_int, "watermark": to_float,
}
OPTION_NAMES = tuple(_READERS)


@dataclass
class ModelOptions:
    """The validated contents of `model.json`."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    engine: Dict[str, Any] = field(default_factory=dict)

    def engine_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for `AsyncLLMEngine(model, **kwargs)` (dtype as a torch.dtype)."""
        import torch

        return dict(dtype=getattr(torch, self.dtype), device=self.device, **self.engine)

    def to_json(self) -> Dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "device": self.device, **self.engine}


def parse_model_options(values: Dict[str, Any]) -> ModelOptions:
    """Validate a `model.json` mapping: unknown names and bad values raise a ValueError."""
    if not isinstance(values, dict):
        raise ValueError(f"{MODEL_JSON} must hold a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(_READERS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} in {MODEL_JSON}; "
                         f"known options: {', '.join(OPTION_NAMES)}")
    read = {key: _READERS[key](key, value) for key, value in values.items()}
    options = ModelOptions(model=read.pop("model", "smollm2"), dtype=read.pop("dtype", "float32"),
                           device=read.pop("device", "cpu"), engine=read)
    if not options.model.strip():
        raise ValueError(f"model in {MODEL_JSON} must name a preset or a model directory")
    EngineConfig.from_kwargs(**dict(options.engine))  # validates ranges, raises ValueError
    return options


def load_model_options(version_dir: Union[str, Path]) -> ModelOptions:
    """Read and validate `model.json` from a model's version folder."""
    path = Path(version_dir) / MODEL_JSON
    if not path.is_file():
        raise ValueError(f"{path} not found: the model's version folder needs a {MODEL_JSON} "
                         f"with the engine options (write one with `paged-backend triton-repo`)")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return parse_model_options(values)
