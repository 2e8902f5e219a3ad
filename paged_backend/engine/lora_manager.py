"""The engine's LoRA adapters: which are known, which are loaded on the host, which sit in the device's slots.

- A request's `LoRARequest` is checked when the request is prepared (any thread): LoRA enabled, its id not
  already naming another adapter, and its PEFT directory read and fitted to the model
  (`lora_checkpoint.check_adapter_fits`). Loaded adapters stay on the host, at most `max_cpu_loras`, least
  recently used dropped first (a dropped one is read from disk again when needed).
- Each step (`step_slots`, engine thread) gives every adapter of the step's tokens one of the `max_loras`
  device slots: adapters already in a slot stay there; the others take free slots, else the least recently
  used slots the step does not need, and travel to the runner in `StepInputs.lora.loads` (the scheduler never
  runs more than `max_loras` adapters at once). An adapter that cannot be read any more fails its requests.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from paged_backend.config import LoRAConfig
from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.core.sequence import SequenceGroup
from paged_backend.engine.lora_request import LoRARequest
from paged_backend.errors import InvalidParameter, InvalidRequest, UnsupportedParameter
from paged_backend.worker.lora_checkpoint import LoRAWeights, check_adapter_fits, read_peft_adapter
from paged_backend.worker.lora_layers import lora_target_shapes
from paged_backend.worker.step_inputs import LoRAStepInputs

_PARAM = "lora_request"


class LoRAManager:
    """Adapters known to one engine, their host copies, and the device slots they occupy."""

    def __init__(self, config: LoRAConfig, model: torch.nn.Module) -> None:
        self.config = config
        self._model_name = type(model).__name__
        self._shapes, self._skipped = lora_target_shapes(model)
        self._lock = threading.Lock()                   # requests are checked in other threads than steps
        self._known: Dict[int, LoRARequest] = {}
        self._host: "OrderedDict[int, LoRAWeights]" = OrderedDict()
        self._slots: List[Optional[int]] = [None] * config.max_loras   # slot -> lora_int_id
        self._slot_used: List[int] = [0] * config.max_loras             # step of its last use
        self._clock = 0
        self.num_slot_loads = 0    # adapters moved into a device slot
        self.num_disk_loads = 0    # adapters read from their directory

    # ---- requests (any thread) ----------------------------------------------------------------
    def check(self, request: LoRARequest) -> None:
        """Refuse a `LoRARequest` this engine cannot serve, reading (and keeping) its weights."""
        if not isinstance(request, LoRARequest):
            raise InvalidParameter(f"lora_request must be a LoRARequest, got {type(request).__name__}", param=_PARAM)
        self._register(request)
        self._weights(request)

    def _register(self, request: LoRARequest) -> None:
        with self._lock:
            known = self._known.get(request.lora_int_id)
            if known is not None and known != request:
                raise InvalidParameter(
                    f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                    f"{known.lora_path!r}; give adapter {request.lora_name!r} its own id", param=_PARAM)
            self._known[request.lora_int_id] = request

    def _weights(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's host weights, read from disk (and checked against the model) unless cached."""
        with self._lock:
            cached = self._host.get(request.lora_int_id)
            if cached is not None:
                self._host.move_to_end(request.lora_int_id)
                return cached
        weights = read_peft_adapter(request.lora_name, request.lora_path)
        check_adapter_fits(weights, self._shapes, self.config.max_lora_rank, self._model_name, self._skipped)
        with self._lock:
            self.num_disk_loads += 1
            self._host[request.lora_int_id] = weights
            self._host.move_to_end(request.lora_int_id)
            while len(self._host) > self.config.max_cpu_loras:
                self._host.popitem(last=False)
        return weights

    def add(self, request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (vLLM's `add_lora`); False if it was loaded already."""
        with self._lock:
            loaded = request.lora_int_id in self._host and self._known.get(request.lora_int_id) == request
        self.check(request)
        return not loaded

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's `remove_lora`): its host copy goes; requests still running with it read it
        from disk again if they need it. False if it was not known."""
        with self._lock:
            self._host.pop(lora_int_id, None)
            return self._known.pop(lora_int_id, None) is not None

    def list(self) -> List[int]:
        """The ids of the adapters loaded on the host."""
        with self._lock:
            return list(self._host)

    # ---- steps (engine thread) ----------------------------------------------------------------
    def assign_slots(self, scheduled: Sequence[ScheduledSeq]) -> Tuple[Dict[int, int], Dict[int, LoRAWeights],
                                                                         Dict[SequenceGroup, str]]:
        """Device slots for the adapters of a step: (lora_int_id -> slot, slot -> weights to load, requests
        whose adapter could not be loaded -> why)."""
        wanted: Dict[int, SequenceGroup] = {}
        for item in scheduled:
            request = item.group.lora_request
            if request is not None:
                wanted.setdefault(request.lora_int_id, item.group)
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, more than max_loras={self.config.max_loras}")
        self._clock += 1
        slot_of: Dict[int, int] = {}
        for slot, lora_id in enumerate(self._slots):
            if lora_id in wanted:
                slot_of[lora_id] = slot
                self._slot_used[slot] = self._clock
        loads: Dict[int, LoRAWeights] = {}
        failed: Dict[int, str] = {}
        for lora_id, group in wanted.items():
            if lora_id in slot_of:
                continue
            try:
                weights = self._weights(group.lora_request)
            except InvalidRequest as exc:
                failed[lora_id] = f"the LoRA adapter could not be loaded: {exc}"
                continue
            slot = min(range(len(self._slots)), key=lambda s: (self._slots[s] is not None, self._slot_used[s]))
            self._slots[slot], self._slot_used[slot] = lora_id, self._clock
            slot_of[lora_id] = loads_slot = slot
            loads[loads_slot] = weights
            self.num_slot_loads += 1
        groups = {item.group: failed[item.group.lora_request.lora_int_id] for item in scheduled
                  if item.group.lora_request is not None and item.group.lora_request.lora_int_id in failed}
        return slot_of, loads, groups

    @staticmethod
    def step_inputs(scheduled: Sequence[ScheduledSeq], slot_of: Dict[int, int],
                    loads: Dict[int, LoRAWeights]) -> Optional[LoRAStepInputs]:
        """Each token's slot for the step's chunks (in the input builder's order), None without adapters."""
        if not slot_of:
            return None
        slots = [slot_of[item.group.lora_request.lora_int_id] if item.group.lora_request is not None else -1
                 for item in scheduled]
        counts = [item.num_tokens for item in scheduled]
        token_slots = torch.from_numpy(np.repeat(np.asarray(slots, dtype=np.int32), counts))
        return LoRAStepInputs(token_slots=token_slots, loads=dict(loads))

    def forget_slots(self) -> None:
        """The runner's slots are unknown (a step failed midway): every adapter is loaded again when next used."""
        self._slots = [None] * self.config.max_loras
        self._slot_used = [0] * self.config.max_loras

    # ---- statistics ---------------------------------------------------------------------------
    @staticmethod
    def adapter_names(groups) -> str:
        """Comma-separated names of the adapters of `groups` (vLLM's label format), sorted."""
        return ",".join(sorted({g.lora_request.lora_name for g in groups if g.lora_request is not None}))


def refuse_lora(request: Optional[LoRARequest]) -> None:
    """An engine without `enable_lora` refuses any request that names an adapter."""
    if request is not None:
        raise UnsupportedParameter("LoRA is not enabled: build the engine with enable_lora=True to serve adapters",
                                   param=_PARAM)
