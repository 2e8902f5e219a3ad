"""`multi_lora.json`: the LoRA adapters of a Triton model, as Triton's vLLM backend reads them: a JSON object of
adapter name -> PEFT directory, in the model's version folder beside `model.json`, read when `model.json` sets
`enable_lora`. A request picks one with `lora_name` in its `sampling_parameters`; ids follow the file's order
(1, 2, ...), as the vLLM backend numbers them. Relative paths are read from the version folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Union

from paged_backend import LoRARequest
from paged_backend.errors import InvalidParameter, UnsupportedParameter

MULTI_LORA_JSON = "multi_lora.json"


def load_multi_lora(version_dir: Union[str, Path]) -> Dict[str, LoRARequest]:
    """name -> LoRARequest from `multi_lora.json`; a ValueError naming the file when it is missing or malformed."""
    path = Path(version_dir) / MULTI_LORA_JSON
    if not path.is_file():
        raise ValueError(f"enable_lora is set in model.json but {path} is not found: it lists the adapters as "
                         f"{{\"name\": \"/path/to/peft/adapter\", ...}}")
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path} must hold a JSON object of adapter name -> adapter directory")
    adapters = {}
    for index, (name, folder) in enumerate(entries.items()):
        if not isinstance(folder, str) or not folder or not name:
            raise ValueError(f"{path}: adapter {name!r} must map to its directory as a string, got {folder!r}")
        location = Path(folder).expanduser()
        adapters[name] = LoRARequest(name, index + 1, str(location if location.is_absolute()
                                                           else Path(version_dir) / location))
    return adapters


def adapter_for(name: Optional[str], adapters: Optional[Mapping[str, LoRARequest]]) -> Optional[LoRARequest]:
    """The adapter a request's `lora_name` selects, refused with the vLLM backend's messages when LoRA is off or
    the name is not in multi_lora.json."""
    if name is None:
        return None
    if adapters is None:
        raise UnsupportedParameter("LoRA feature is not enabled: this model serves no LoRA adapters (set enable_lora "
                                   "in model.json and list them in multi_lora.json)", param="lora_name")
    if not isinstance(name, str) or name not in adapters:
        raise InvalidParameter(f"LoRA {name} is not supported, we currently support {list(adapters)}",
                               param="lora_name")
    return adapters[name]
