"""What a model runner needs for one step, and the small protocol every runner implements.

The engine builds `StepInputs` (see `input_builder.py`); a runner (`ModelRunner`, or the
tensor-parallel runner that forwards them to every rank) executes them. Device-side code imports this
module and nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch


@dataclass
class LoRAStepInputs:
    """The step's adapters: each token's adapter slot (-1: the base model; host int32 `[T]`), and the slots
    to fill before the forward (slot -> `LoRAWeights` on the host, or None to empty it)."""

    token_slots: torch.Tensor
    loads: Dict[int, Any] = field(default_factory=dict)


@dataclass
class DeviceFill:
    """Input ids that the previous step sampled and left on the device: `input_ids[positions] = tokens[rows]`,
    applied there once the inputs are (a runner that `fills_on_device` applies it; nothing waits for the host)."""

    positions: torch.Tensor   # [P] int64 on the host: indices into the step's input ids
    rows: torch.Tensor        # [P] int64 on the host: rows of `tokens`
    tokens: torch.Tensor      # [R] int64 on the device: the previous step's tokens

    def apply(self, input_ids: torch.Tensor) -> None:
        """Wherever the ids and the tokens are (the engine's host fill calls it too); a copy to a device does not
        wait, one to the host does (its values are read next)."""
        to_device = input_ids.device.type != "cpu"
        values = self.tokens[self.rows.to(self.tokens.device, non_blocking=True)]
        input_ids[self.positions.to(input_ids.device, non_blocking=to_device)] = \
            values.to(input_ids.device, non_blocking=to_device)


@dataclass
class StepInputs:
    """Everything a worker needs to run one step (rank 0 builds it; tensor-parallel ranks receive it)."""

    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    slot_mapping: torch.Tensor     # [T]
    block_tables: torch.Tensor     # [S, max_blocks] int32
    context_lens: torch.Tensor     # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    sample_indices: torch.Tensor   # [N] rows whose logits the sampler needs
    swap_out: Dict[int, int] = field(default_factory=dict)
    swap_in: Dict[int, int] = field(default_factory=dict)
    copies: List[Tuple[int, int]] = field(default_factory=list)
    lora: Optional[LoRAStepInputs] = None   # None: no token of the step has an adapter
    device_fill: Optional[DeviceFill] = None   # pending input ids the runner fills on the device

    def to(self, device) -> "StepInputs":
        """The inputs on `device`: themselves when they are there already (built together, their tensors share
        a device), so a CPU step makes no tensor call here."""
        if self.input_ids.device == torch.device(device):
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return StepInputs(**{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                             for k, v in values.items()})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class Runner(Protocol):
    """What the engine calls on a model runner, and nothing else."""

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Apply the step's swaps and copies, run the model, return logits of the sampled rows. A runner may also
        take `on_launched`, a callable it runs once the forward is on its way and the host is free until the
        results (overlapped scheduling then hands the previous step's results to the engine at that moment;
        without the parameter, the engine runs it before the call)."""

    def shutdown(self) -> None:
        """Release workers and the KV cache."""
