"""LoRA deltas around the model's own linear layers, per token by adapter slot.

`LoRALayers` keeps `max_loras` slots of adapter weights on the device. The first adapter that targets a
module installs a forward hook on it; during a step (`with layers.step(plan)`) the hook adds each token's
adapter delta to the module's output (`kernels.lora`: on the CPU the dense masked matmuls while the slots'
stacked ranks are few columns, else grouped matmuls per adapter; on a GPU the Triton segmented kernels). The HF
modules themselves are never replaced or modified, and outside a step that has adapter tokens the hooks add
nothing.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from paged_backend.kernels.lora import LoRAPlan, lora_backend, lora_delta_dense, lora_delta_grouped, slot_columns
from paged_backend.worker.lora_checkpoint import LoRAModule, LoRAWeights, check_adapter_fits


def _linear_shape(module: torch.nn.Module) -> Optional[Tuple[int, int]]:
    """(in, out) of a linear layer: `nn.Linear`, or transformers' `Conv1D` (GPT-2; its weight is [in, out])."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2:
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def lora_target_shapes(model: torch.nn.Module) -> Tuple[Dict[str, Tuple[int, int]], Dict[str, str]]:
    """The modules an adapter may target, name -> (in, out), and the linear-looking ones it may not, with why."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes, skipped = {}, {}
    for name, module in model.named_modules():
        if output is not None and module is output:
            skipped[name] = "the output layer (its logits are computed only for sampled rows): not supported"
        elif isinstance(module, torch.nn.Embedding):
            skipped[name] = "an embedding: embedding LoRA is not supported"
        else:
            shape = _linear_shape(module)
            if shape is not None:
                shapes[name] = shape
    return shapes, skipped


class _Layer:
    """One adapted module's weights for every slot, side by side: `a_cat` `[slots * max_rank, in]` and `b_cat`
    `[out, slots * max_rank]` (zero beyond an adapter's own rank), the same B times each slot's scale for the dense
    path, the scales per slot, and the exact `(A, B, scale)` views of each slot for the grouped path."""

    def __init__(self, num_slots: int, max_rank: int, shape: Tuple[int, int], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.in_features, self.out_features = shape
        self.a_cat = torch.zeros(num_slots * max_rank, self.in_features, device=device, dtype=dtype)
        self.b_cat = torch.zeros(self.out_features, num_slots * max_rank, device=device, dtype=dtype)
        self.scales = torch.zeros(num_slots, device=device, dtype=torch.float32)
        self.b_scaled_cat = torch.zeros(self.out_features, num_slots * max_rank, device=device, dtype=dtype)  # dense
        self.entries: List[Optional[Tuple[torch.Tensor, torch.Tensor, float]]] = [None] * num_slots

    def set(self, slot: int, lora: LoRAModule) -> None:
        first, rank = slot * self.max_rank, lora.rank
        columns = slice(first, first + self.max_rank)
        self._zero(columns)
        self.a_cat[first:first + rank] = lora.lora_a
        self.b_cat[:, first:first + rank] = lora.lora_b
        self.b_scaled_cat[:, first:first + rank] = lora.lora_b * lora.scaling
        self.scales[slot] = lora.scaling
        self.entries[slot] = (self.a_cat[first:first + rank], self.b_cat[:, first:first + rank], lora.scaling)

    def clear(self, slot: int) -> None:
        self.entries[slot] = None
        self.scales[slot] = 0.0
        self._zero(slice(slot * self.max_rank, (slot + 1) * self.max_rank))   # a cleared slot adds nothing

    def _zero(self, columns: slice) -> None:
        self.a_cat[columns].zero_()
        self.b_cat[:, columns].zero_()
        self.b_scaled_cat[:, columns].zero_()

    def apply(self, y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, mode: str,
              columns: Optional[torch.Tensor]) -> None:
        if not any(self.entries[s.slot] is not None for s in plan.segments):
            return
        if mode == "dense":
            lora_delta_dense(y, x, columns, self.a_cat, self.b_scaled_cat)
        elif mode == "triton":
            from paged_backend.kernels.triton_lora import lora_delta_triton

            a = self.a_cat.view(self.num_slots, self.max_rank, self.in_features)
            b = self.b_cat.view(self.out_features, self.num_slots, self.max_rank).permute(1, 0, 2)
            lora_delta_triton(y, x, plan, a, b, self.scales)
        else:
            lora_delta_grouped(y, x, plan, self.entries)


# The dense CPU path multiplies every token by every slot's A and B: worth it (one op per layer instead of one per
# adapter) while the slots' columns are few next to the layer's width; above this, the grouped path.
DENSE_MAX_COLUMNS = 256


def lora_mode(probe: torch.Tensor, max_loras: int, max_lora_rank: int) -> str:
    """'triton' (CUDA, or forced), 'dense' or 'grouped' for adapters of these slots on `probe`'s device/dtype."""
    if lora_backend(probe) == "triton":
        return "triton"
    return "dense" if max_loras * max_lora_rank <= DENSE_MAX_COLUMNS else "grouped"


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _hook(layers: "weakref.ref[LoRALayers]", name: str):
    """A forward hook that holds its `LoRALayers` weakly: once the runner is gone it does nothing."""
    def add_lora(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        owner = layers()
        if owner is not None:
            owner.apply(name, args[0], output)
        return None

    return add_lora


class LoRALayers:
    """The adapter slots of one model and the hooks that apply them."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.shapes, self.skipped = lora_target_shapes(model)
        self._modules = dict(model.named_modules())
        self.mode = lora_mode(torch.empty(0, device=self.device, dtype=self.dtype), max_loras, max_lora_rank)
        self._step = threading.local()   # the step's plan (and mask), seen only by the thread running the step:
        # another engine's forward on the same model, in another thread, passes these hooks untouched
        self._layers: Dict[str, _Layer] = {}
        self._hooks: list = []
        weakref.finalize(self, _remove_all, self._hooks)   # a dropped runner leaves no hooks behind
        self.slots: List[Optional[LoRAWeights]] = [None] * max_loras

    def check(self, weights: LoRAWeights) -> None:
        """Refuse an adapter that does not fit this model (see `check_adapter_fits`)."""
        check_adapter_fits(weights, self.shapes, self.max_lora_rank, type(self.model).__name__, self.skipped)

    def load(self, slot: int, weights: Optional[LoRAWeights]) -> None:
        """Put an adapter (checked, any device and dtype) in a slot, replacing what it held; None empties it."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of range (max_loras={self.max_loras})")
        previous = self.slots[slot]
        if previous is not None:
            for name in previous.modules:
                self._layers[name].clear(slot)
        self.slots[slot] = None
        if weights is None:
            return
        self.check(weights)
        weights = weights.to(self.device, self.dtype)
        for name, lora in weights.modules.items():
            self._layer(name).set(slot, lora)
        self.slots[slot] = weights

    def _layer(self, name: str) -> _Layer:
        layer = self._layers.get(name)
        if layer is None:
            layer = _Layer(self.max_loras, self.max_lora_rank, self.shapes[name], self.device, self.dtype)
            self._layers[name] = layer
            handle = self._modules[name].register_forward_hook(_hook(weakref.ref(self), name))
            self._hooks.append(handle)
        return layer

    def apply(self, name: str, x: torch.Tensor, output: torch.Tensor) -> None:
        """The hook's work: add the step's deltas to `output` of module `name` (nothing outside a step)."""
        plan = getattr(self._step, "plan", None)
        if plan is None:
            return
        layer = self._layers[name]
        rows = x.numel() // layer.in_features
        if rows != plan.num_tokens or output.shape[-1] != layer.out_features:
            raise ValueError(f"LoRA on {name!r}: the module ran on {rows} rows but the step has "
                             f"{plan.num_tokens} tokens; adapters can target only layers that see every token")
        layer.apply(output.view(-1, layer.out_features), x.reshape(-1, layer.in_features), plan, self.mode,
                    self._step.columns)

    @contextlib.contextmanager
    def step(self, plan: Optional[LoRAPlan]) -> Iterator[None]:
        """Apply the adapters of `plan`'s tokens during the forward inside this block."""
        self._step.plan, self._step.columns = plan, None
        if plan is not None and self.mode == "dense":
            self._step.columns = slot_columns(plan.token_slots, self.max_loras, self.max_lora_rank, self.dtype)
        try:
            yield
        finally:
            self._step.plan = self._step.columns = None

    def remove(self) -> None:
        """Take the hooks off the model (the runner is done with it)."""
        _remove_all(self._hooks)
        self._layers.clear()
        self.slots = [None] * self.max_loras
