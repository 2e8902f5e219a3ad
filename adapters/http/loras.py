"""The server's LoRA adapters by name: started with `--lora-modules name=path`, added and removed at run time
through vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`. An OpenAI request's `model`, or a TGI
request's `adapter_id`, that names one runs with it; the served model's own name (or none) is the base model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from paged_backend import LoRARequest


def parse_lora_module(text: str) -> LoRARequest:
    """One `--lora-modules` entry, as vLLM writes it: `name=path` or `{"name": ..., "path": ...}` (the id is set
    when the server registers it)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({exc})") from None
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise ValueError(f"--lora-modules {text!r}: a JSON entry needs \"name\" and \"path\"")
        name, path = str(value["name"]), str(value["path"])
    else:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: write name=path (or a JSON object with name and path)")
    return LoRARequest(name, 1, path)


@dataclass
class ServedAdapters:
    """name -> `LoRARequest`; every adapter gets a fresh id, so a name loaded again after an unload never shares
    cached KV with its earlier weights."""

    base_name: str
    adapters: Dict[str, LoRARequest] = field(default_factory=dict)
    enabled: bool = False
    _ids: "itertools.count[int]" = field(default_factory=lambda: itertools.count(1))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def register(self, name: str, path: str) -> LoRARequest:
        """A new adapter entry (not checked here: the engine reads it)."""
        if name == self.base_name:
            raise ValueError(f"the adapter name {name!r} is the served model's own name")
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        self.adapters[lora.lora_name] = lora

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's model name selects, or None (the base model, or a name that is not an
        adapter's: any model name is accepted, as before)."""
        return self.adapters.get(model) if model else None

    def names(self) -> List[str]:
        return sorted(self.adapters)

    @property
    def lock(self) -> asyncio.Lock:
        return self._lock


def served_adapters(base_name: str, enabled: bool, modules: Iterable[LoRARequest] = ()) -> ServedAdapters:
    """The registry of an app, with the adapters the server started with."""
    served = ServedAdapters(base_name, enabled=enabled)
    for lora in modules:
        if lora.lora_name == base_name:
            raise ValueError(f"the adapter name {lora.lora_name!r} is the served model's own name")
        served.add(lora)
    if served.adapters:
        served._ids = itertools.count(max(lo.lora_int_id for lo in served.adapters.values()) + 1)
    return served
