"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) into per-module
weights, and checking them against a model: every refusal is an `InvalidParameter` naming what does not fit.

PEFT's arithmetic is kept: a module's delta is `lora_B(lora_A(x)) * scaling` with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`), `r` and `lora_alpha` per module after `rank_pattern` /
`alpha_pattern`. Features that change that arithmetic (DoRA, LoRA biases, `modules_to_save`, trainable
tokens, embedding or output-layer targets, ...) are refused by name, never ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from paged_backend.errors import InvalidParameter, UnsupportedParameter

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# adapter_config.json keys whose non-default values change the arithmetic; refused
_UNSUPPORTED = {
    "use_dora": "DoRA adapters", "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save (full copies of "
    "modules)", "trainable_token_indices": "trainable token embeddings", "target_parameters": "LoRA on parameters "
    "(target_parameters)", "layer_replication": "layer replication", "alora_invocation_tokens": "activated LoRA "
    "(alora_invocation_tokens)", "use_qalora": "QA-LoRA", "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
_PARAM = "lora_request"


@dataclass
class LoRAModule:
    """One adapted module: `lora_a` `[r, in]`, `lora_b` `[out, r]`, and PEFT's scaling."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class LoRAWeights:
    """A loaded adapter: its name and the weights of every module it adapts (named as in the HF model)."""

    name: str
    modules: Dict[str, LoRAModule]

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
                   for m in self.modules.values())

    def to(self, device: torch.device, dtype: torch.dtype) -> "LoRAWeights":
        """A copy on `device` in `dtype` (the model's)."""
        return LoRAWeights(self.name, {name: LoRAModule(m.lora_a.to(device=device, dtype=dtype).contiguous(),
                                                        m.lora_b.to(device=device, dtype=dtype).contiguous(),
                                                        m.scaling)
                                       for name, m in self.modules.items()})


def _fail(name: str, message: str, unsupported: bool = False) -> None:
    error = UnsupportedParameter if unsupported else InvalidParameter
    raise error(f"LoRA adapter {name!r}: {message}", param=_PARAM)


def read_config(name: str, directory: Path) -> Dict[str, Any]:
    """The adapter's `adapter_config.json`, checked for a LoRA adapter this engine can apply."""
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        _fail(name, f"{directory} is not a directory (a PEFT adapter directory holds {CONFIG_FILE} and "
                    f"{WEIGHT_FILES[0]})")
    if not path.is_file():
        _fail(name, f"{path} not found (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHT_FILES[0]})")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _fail(name, f"cannot read {path}: {exc}")
    if not isinstance(config, dict):
        _fail(name, f"{path} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        _fail(name, f"peft_type {peft_type!r} is not a LoRA adapter", unsupported=True)
    for key, what in _UNSUPPORTED.items():
        if config.get(key) not in (None, False, [], {}, ()):
            _fail(name, f"{what} ({key}={config[key]!r}) are not supported", unsupported=True)
    if str(config.get("bias", "none")) != "none":
        _fail(name, f"bias={config['bias']!r} is not supported (only 'none')", unsupported=True)
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            _fail(name, f"{key} must be a positive number in {CONFIG_FILE}, got {value!r}")
    return config


def _read_tensors(name: str, directory: Path) -> Mapping[str, torch.Tensor]:
    for file in WEIGHT_FILES:
        path = directory / file
        if not path.is_file():
            continue
        try:
            if file.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the adapter's fault
            _fail(name, f"cannot read {path}: {type(exc).__name__}: {exc}")
    _fail(name, f"no {' or '.join(WEIGHT_FILES)} in {directory}")
    raise AssertionError("unreachable")


def _pattern_value(pattern: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: the first key that matches the end of the module name."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _pairs(name: str, tensors: Mapping[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """module name -> {"A": tensor, "B": tensor}, from PEFT's saved keys."""
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    embedding = next((key for key in tensors if "lora_embedding" in key), None)
    if embedding is not None:
        _fail(name, f"{embedding!r} is embedding LoRA: not supported", unsupported=True)
    for key, tensor in tensors.items():
        module_key = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        found = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", module_key)
        if found is None:
            if key.endswith(".base_layer.weight") or key.endswith(".weight") and ".lora_" not in key:
                what = "a full weight of the base model saved with the adapter (PEFT's save_embedding_layers)"
            else:
                what = "a tensor that is not a LoRA A/B weight"
            _fail(name, f"{key!r} is {what}: not supported", unsupported=True)
        if tensor.dim() != 2 or not tensor.is_floating_point():
            _fail(name, f"{key!r} must be a 2-D float tensor, got {tuple(tensor.shape)} {tensor.dtype}")
        pairs.setdefault(found.group(1), {})[found.group(2)] = tensor
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            _fail(name, f"module {module!r} has lora_{'A' if 'A' in pair else 'B'} but no "
                        f"lora_{'B' if 'A' in pair else 'A'}")
    if not pairs:
        _fail(name, "the adapter holds no LoRA weights")
    return pairs


def read_peft_adapter(name: str, path: str) -> LoRAWeights:
    """Load a PEFT LoRA directory into host tensors (their saved dtype) with PEFT's per-module scaling."""
    directory = Path(path).expanduser()
    config = read_config(name, directory)
    modules = {}
    for module, pair in _pairs(name, _read_tensors(name, directory)).items():
        lora_a, lora_b = pair["A"], pair["B"]
        rank = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"]))
        if lora_a.shape[0] != rank or lora_b.shape[1] != rank:
            _fail(name, f"module {module!r}: lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)} do not "
                        f"have the rank r={rank} of {CONFIG_FILE}")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = LoRAModule(lora_a, lora_b, scaling)
    return LoRAWeights(name, modules)


def check_adapter_fits(weights: LoRAWeights, module_shapes: Mapping[str, Tuple[int, int]], max_lora_rank: int,
                       model_name: str = "the model", skipped: Optional[Mapping[str, str]] = None) -> None:
    """Refuse an adapter that does not fit the model: an unknown target module, one that is not a linear layer
    over every token (`skipped` says why some are not), a weight shape other than the module's (in, out), or a
    rank above `max_lora_rank`."""
    for module, lora in sorted(weights.modules.items()):
        if module not in module_shapes:
            why = (skipped or {}).get(module)
            _fail(weights.name, f"targets module {module!r}, " + (why if why else f"which {model_name} does not have"),
                  unsupported=why is not None)
        in_features, out_features = module_shapes[module]
        if lora.lora_a.shape[1] != in_features or lora.lora_b.shape[0] != out_features:
            _fail(weights.name, f"module {module!r}: lora_A {tuple(lora.lora_a.shape)} / lora_B "
                                f"{tuple(lora.lora_b.shape)} do not fit its {in_features} inputs and "
                                f"{out_features} outputs in {model_name} (an adapter for another base model?)")
        if lora.rank > max_lora_rank:
            _fail(weights.name, f"module {module!r} has rank {lora.rank}, above max_lora_rank={max_lora_rank}")
