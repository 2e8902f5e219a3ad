"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from paged_backend.errors import InvalidParameter


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) under a name and an integer
    id > 0 that the caller keeps unique per adapter (the engine refuses one id used for two adapters)."""

    lora_name: str
    lora_int_id: int
    lora_path: Union[str, Path] = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameter(f"lora_name must be a non-empty string, got {self.lora_name!r}",
                                   param="lora_request")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidParameter(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}",
                                   param="lora_request")
        if not str(self.lora_path):
            raise InvalidParameter(f"LoRA adapter {self.lora_name!r}: lora_path must name its PEFT directory",
                                   param="lora_request")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of `lora_int_id`."""
        return self.lora_int_id

    def cache_key(self) -> bytes:
        """What a prefix-cache block hash starts from for this adapter: id, name and path, so that KV computed
        under one adapter is never reused under another."""
        text = f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"
        return hashlib.sha256(text.encode("utf-8")).digest()
