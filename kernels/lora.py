"""LoRA deltas for a step whose tokens use different adapters: `y[t] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T` for
every token t of adapter slot s, all slots in one call (Punica / S-LoRA's segmented gather matmul).

`plan_lora(token_slots)` groups a step's tokens by slot once (stable, so each segment keeps the tokens' order);
every LoRA-wrapped layer of the step reuses the plan. Three implementations:
- `lora_delta_dense` (PyTorch, the CPU's default while the slots' ranks are few columns): every token against
  every slot's A at once (the slots' A stacked, `[slots * rank, in]`), its own slot's columns kept by a
  one-hot mask (`slot_columns`), then the stacked scale * B added in place: two matmuls and a multiply per
  layer whatever the number of adapters (a step's Python and op count is what a CPU step pays for).
- `lora_delta_grouped` (PyTorch, any device): per slot one gather, two small matmuls in PEFT's order
  (`F.linear(F.linear(x, A), B) * scale`) and one `index_add_`; a slot whose tokens are one contiguous run is
  read and written through a slice, no copy. Used when the stacked columns would outweigh the layer.
- `lora_delta_triton` (kernels/triton_lora.py): two kernels over the sorted segments, shrink (x @ A^T into
  an fp32 buffer) and expand (times B^T and the scale, added to y), reading stacked adapter weights.
`PAGED_BACKEND_KERNELS` chooses as for attention: Triton for CUDA tensors, PyTorch otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

Rows = Union[slice, torch.Tensor]


@dataclass
class LoRASegment:
    """The tokens of one adapter slot in a step: `rows` (a slice when they are contiguous, else an index
    tensor on the device) and their range `[start, end)` in the plan's sorted order."""

    slot: int
    start: int
    end: int
    rows: Rows


@dataclass
class LoRAPlan:
    """A step's tokens with an adapter, grouped by slot (tokens without one, slot -1, are left out)."""

    num_tokens: int
    token_slots: torch.Tensor  # [T] int64 on the device: each token's slot, -1 without an adapter
    segments: List[LoRASegment]
    order: torch.Tensor        # [N] int64: token rows sorted by slot (stable)
    seg_starts: torch.Tensor   # [S + 1] int32: segment boundaries in `order`
    seg_slots: torch.Tensor    # [S] int32
    max_segment: int           # the longest segment's length

    @property
    def num_lora_tokens(self) -> int:
        return int(self.order.shape[0])


def plan_lora(token_slots: Union[np.ndarray, torch.Tensor], device: Union[str, torch.device] = "cpu"
              ) -> Optional[LoRAPlan]:
    """Group tokens by adapter slot from the host's `token_slots` `[T]` (-1: no adapter); None when no token
    has an adapter. Python touches each slot once, never each token."""
    slots = np.asarray(token_slots.cpu() if isinstance(token_slots, torch.Tensor) else token_slots, dtype=np.int64)
    if slots.ndim != 1:
        raise ValueError(f"token_slots must be one-dimensional, got shape {slots.shape}")
    with_adapter = np.flatnonzero(slots >= 0)
    if with_adapter.size == 0:
        return None
    order = with_adapter[np.argsort(slots[with_adapter], kind="stable")]
    sorted_slots = slots[order]
    bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
    starts = np.concatenate(([0], bounds, [order.size]))
    order_t = torch.from_numpy(order).to(device)
    segments = []
    for i in range(starts.size - 1):
        start, end = int(starts[i]), int(starts[i + 1])
        first, last = int(order[start]), int(order[end - 1])
        rows: Rows = slice(first, last + 1) if last - first == end - start - 1 else order_t[start:end]
        segments.append(LoRASegment(int(sorted_slots[start]), start, end, rows))
    return LoRAPlan(num_tokens=int(slots.size), token_slots=torch.from_numpy(slots).to(device), segments=segments,
                    order=order_t,
                    seg_starts=torch.from_numpy(starts.astype(np.int32)).to(device),
                    seg_slots=torch.from_numpy(sorted_slots[starts[:-1]].astype(np.int32)).to(device),
                    max_segment=int(np.diff(starts).max()))


SlotWeights = Optional[Tuple[torch.Tensor, torch.Tensor, float]]   # (A [r, in], B [out, r], scale) or None


def lora_delta_grouped(y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, weights: Sequence[SlotWeights]) -> None:
    """Add each slot's delta to its tokens' rows of `y` `[T, out]` in place (`x` `[T, in]`); slots whose
    `weights` entry is None (an adapter that does not target this layer) are skipped."""
    for segment in plan.segments:
        entry = weights[segment.slot]
        if entry is None:
            continue
        lora_a, lora_b, scale = entry
        rows = segment.rows
        delta = F.linear(F.linear(x[rows], lora_a), lora_b) * scale
        if isinstance(rows, slice):
            y[rows].add_(delta)
        else:
            y.index_add_(0, rows, delta)


def slot_columns(token_slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """`[T, num_slots * rank]`: 1 on the `rank` columns of each token's slot, 0 elsewhere (all 0 for a token without
    an adapter, slot -1), on `token_slots`' device."""
    num_tokens = token_slots.shape[0]
    columns = torch.zeros(num_tokens, num_slots, rank, dtype=dtype, device=token_slots.device)
    rows = torch.nonzero(token_slots >= 0).flatten()
    columns[rows, token_slots[rows].long()] = 1
    return columns.view(num_tokens, num_slots * rank)


def lora_delta_dense(y: torch.Tensor, x: torch.Tensor, columns: torch.Tensor, a_cat: torch.Tensor,
                     b_scaled_cat: torch.Tensor) -> None:
    """`y += ((x @ a_cat^T) * columns) @ b_scaled_cat^T` in place, three ops: `a_cat` `[slots * rank, in]` and
    `b_scaled_cat` `[out, slots * rank]` are every slot's A and scale * B side by side (zero beyond an adapter's own
    rank, and for a slot whose adapter does not target the layer), `columns` is `slot_columns` (each token's own
    slot's columns 1, the others 0)."""
    h = F.linear(x, a_cat)
    h.mul_(columns)
    y.addmm_(h, b_scaled_cat.t())


def lora_backend(tensor: torch.Tensor) -> str:
    """'triton' or 'torch' for the LoRA op on `tensor`, as `kernel_backend` chooses for attention (the C++
    backend's LoRA is the PyTorch one; float64 always takes PyTorch)."""
    from . import kernel_backend

    backend = kernel_backend(tensor)
    return "triton" if backend == "triton" and tensor.dtype != torch.float64 else "torch"


__all__ = ["LoRAPlan", "LoRASegment", "lora_backend", "lora_delta_dense", "lora_delta_grouped", "plan_lora",
           "slot_columns"]
