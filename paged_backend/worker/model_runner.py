"""One forward of an unmodified Hugging Face model per step, the whole step packed as one row.

`ModelRunner.execute` applies the step's block swaps and copies (`StepInputs`, built on the engine
side by `input_builder.prepare_inputs`), then runs the model with our attention function and returns
logits only for the rows that sample. The device side: it knows nothing of the scheduler or engine.
"""

from __future__ import annotations

import contextlib
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional

import torch

from paged_backend.kernels.lora import LoRAPlan, plan_lora
from paged_backend.worker.attention import ATTENTION_NAME, AttentionMetadata, attention_context, register_attention
from paged_backend.worker.cache_engine import CacheEngine
from paged_backend.config import compile_mode
from paged_backend.worker.compiled_forward import CompiledForward, eager_forward
from paged_backend.worker.cuda_graphs import DecodeGraphs, GraphConfig
from paged_backend.worker.huge_pages import HugePageWeights, move_weights_to_huge_pages
from paged_backend.worker.trace_exclusion import TRACE_EXCLUSION
from paged_backend.worker.lora_layers import LoRALayers
from paged_backend.worker.model_support import check_model_supported
from paged_backend.worker.step_inputs import StepInputs


def attention_layers(model: torch.nn.Module) -> Dict[int, int]:
    """id(attention module) -> cache layer, from the modules' `layer_idx`."""
    layers = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and "attention" in type(module).__name__.lower():
            layers[id(module)] = idx
    return layers


_ATTENTION_LOCK = threading.Lock()
_ATTENTION_USERS: Dict[int, list] = {}   # id(model config) -> [steps and compilations using it, previous attention]


@contextmanager
def paged_attention_on(config) -> Iterator[None]:
    """Our attention function as the implementation of the model with this config while any step or compilation
    of any runner on it runs (engines may share one model object, each stepping in its own thread); the previous
    implementation is back when the last one ends, whatever their order."""
    key = id(config)
    with _ATTENTION_LOCK:
        entry = _ATTENTION_USERS.get(key)
        if entry is None:
            entry = _ATTENTION_USERS[key] = [0, config._attn_implementation]
            config._attn_implementation = ATTENTION_NAME
        entry[0] += 1
    try:
        yield
    finally:
        with _ATTENTION_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _ATTENTION_USERS[key]
                config._attn_implementation = entry[1]


class ModelRunner:
    """Runs steps of one model over its paged KV cache."""

    def __init__(self, model: torch.nn.Module, cache_engine: CacheEngine, lora: Optional[LoRALayers] = None,
                 compile: object = False, graphs: Optional[GraphConfig] = None) -> None:
        """`graphs`: replay decode steps from buckets of static buffers (CUDA graphs on CUDA; see cuda_graphs.py)."""
        check_model_supported(model)
        self.lora = lora
        register_attention()
        self.model = model
        self.cache_engine = cache_engine
        self.device = next(model.parameters()).device
        # steps may leave their input ids that the previous step sampled to be filled here, on the device
        # (`StepInputs.device_fill`): on a GPU nothing then waits for the host between two forwards
        self.fills_on_device = self.device.type == "cuda"
        # a step reads every weight: on the CPU, from huge pages where the kernel lends them (huge_pages.py)
        self.huge_pages = (move_weights_to_huge_pages(model) if self.device.type == "cpu"
                           else HugePageWeights(0, 0, 0))
        self.layer_of = attention_layers(model)
        if len(set(self.layer_of.values())) != cache_engine.geometry.num_layers:
            raise ValueError(f"{type(model).__name__}: found {len(set(self.layer_of.values()))} attention layers "
                             f"with a layer index, expected {cache_engine.geometry.num_layers}")
        self.compiled: Optional[CompiledForward] = None   # compile=...: the compiled forward (compiled_forward.py)
        self.forward = eager_forward(model)
        if compile_mode(compile) != "off":
            self.compiled = self.forward = CompiledForward(model, cache_engine, compile_mode(compile),
                                                           self._paged_attention)
        self.graphs: Optional[DecodeGraphs] = None
        if graphs is not None:
            if self.compiled is not None or lora is not None:
                raise ValueError("decode graphs cannot run with compile or LoRA (their steps choose code per step)")
            self.graphs = DecodeGraphs(self.forward, cache_engine, self.layer_of, graphs, self._step_context)

    def _paged_attention(self):
        """Our attention function as the model's implementation while a step or a compilation (which may run in
        another thread, for tens of seconds) uses it (`paged_attention_on`)."""
        return paged_attention_on(self.model.config)

    @contextmanager
    def _step_context(self) -> Iterator[None]:
        """What every forward of a step runs in (no_grad, not inference_mode: the logits leave the runner and the
        sampler edits them in place, which inference tensors forbid outside inference mode)."""
        with torch.no_grad(), self._paged_attention(), TRACE_EXCLUSION.forward():
            yield

    def execute(self, inputs: StepInputs, on_launched: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """Swap, copy, then one forward; returns logits `[len(sample_indices), vocab]`. `on_launched` runs when
        the host is free until the logits: before a CPU forward (it holds this thread throughout), after an
        accelerator's forward (or graph replay) is queued (on a GPU this ran once, 2026-12-04: docs/gpu.md)."""
        queued_on_device = on_launched is not None and self.device.type != "cpu"
        if on_launched is not None and not queued_on_device:
            on_launched()
        self.cache_engine.swap_out(inputs.swap_out)
        self.cache_engine.swap_in(inputs.swap_in)
        self.cache_engine.copy(inputs.copies)
        if inputs.num_tokens == 0:
            if queued_on_device:
                on_launched()
            return torch.empty(0, 0)
        bucket = self.graphs.bucket_for(inputs) if self.graphs is not None else None
        if bucket is not None:   # a decode step: one graph replay (the host inputs copied into its buffers)
            logits = self.graphs.run(inputs, bucket)   # it applies the step's device fill to its buffers
            if queued_on_device:
                on_launched()
            return logits
        lora_plan = self._lora_plan(inputs)
        inputs = inputs.to(self.device)
        if inputs.device_fill is not None:
            inputs.device_fill.apply(inputs.input_ids)
        metadata = AttentionMetadata(
            slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables, context_lens=inputs.context_lens,
            query_start_loc=inputs.query_start_loc, block_size=self.cache_engine.block_size,
            kv_caches=self.cache_engine.kv_caches, layer_of=self.layer_of, kv_scales=self.cache_engine.kv_scales)
        with self._step_context(), attention_context(metadata), self._lora_step(lora_plan):
            logits = self.forward(inputs.input_ids, inputs.positions, inputs.sample_indices)
        if queued_on_device:
            on_launched()
        return logits

    def _lora_plan(self, inputs: StepInputs) -> Optional[LoRAPlan]:
        """Fill the adapter slots the step asks for, and group its tokens by slot (None: no adapter tokens)."""
        if inputs.lora is None:
            return None
        if self.lora is None:
            raise ValueError("the step has LoRA tokens but this runner was built without LoRA (enable_lora)")
        for slot, weights in inputs.lora.loads.items():
            self.lora.load(slot, weights)
        return plan_lora(inputs.lora.token_slots, self.device)

    def _lora_step(self, plan: Optional[LoRAPlan]):
        return self.lora.step(plan) if self.lora is not None else contextlib.nullcontext()

    def shutdown(self) -> None:
        """Release the KV cache (and take the LoRA hooks off the model); the runner cannot run steps afterwards."""
        if self.lora is not None:
            self.lora.remove()
        self.cache_engine.release()
