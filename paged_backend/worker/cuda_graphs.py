"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's CUDA graphs).

On a GPU a small model's decode step is a few hundred kernel launches, each a few microseconds of host time
while the device waits. A CUDA graph records the launches of one forward once and replays them with one call.
A graph replays fixed addresses and shapes, so `DecodeGraphs` keeps static input buffers sized for the largest
bucket, and a decode step of `n` sequences runs the graph of the smallest bucket `B >= n`: its inputs are copied
into the buffers' first `n` rows, rows `n..B` are padding (token 0 at position 0, slot -1 so the cache kernel
writes nothing, context of one token read from block 0), and the logits of the first `n` rows are returned.

Only pure decode steps replay (one new token per sequence, every row sampled, no LoRA, no wider block table than
`max_model_len` needs); prefill, mixed and speculative steps run eagerly. The attention kernels choose their
tiles and split-KV from shapes alone (the table width is the buffers' `max_blocks`), so what a graph recorded
is what eager launches would do for the same padded step.

`capture=False` runs the same padded steps on the same buffers eagerly instead of replaying: the CPU tests check
the bucketing, padding and copies this way (no CUDA here), and the GPU check compares replayed tokens with it.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

import torch

from paged_backend.kernels import kernel_backend
from paged_backend.worker.attention import AttentionMetadata, attention_context
from paged_backend.worker.cache_engine import CacheEngine
from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> List[int]:
    """Batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to `max_num_seqs` (as vLLM pads)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


@dataclass
class GraphConfig:
    """The runner's decode buckets: sized for the engine's `max_num_seqs` and `max_model_len`; `capture=False`
    runs the padded steps eagerly (tests on the CPU; the GPU check's reference)."""

    max_num_seqs: int
    max_model_len: int
    capture: bool = True
    buckets: Optional[Sequence[int]] = None   # None: graph_buckets(max_num_seqs)


@dataclass
class GraphStats:
    """What was captured, and how the decode steps ran."""

    capture: bool
    buckets: List[int] = field(default_factory=list)   # captured (or, capture=False, prepared) batch sizes
    seconds: Optional[float] = None                    # capture time of all buckets
    error: Optional[str] = None                        # why capture failed (every step then runs eagerly)
    retried_after: Optional[str] = None                # why a first attempt failed (the second one decides)
    replays: int = 0                                   # decode steps run through the buckets
    padded_rows: int = 0                               # padding rows those steps computed

    def as_dict(self) -> dict:
        return {"capture": self.capture, "buckets": self.buckets, "seconds": self.seconds, "error": self.error,
                "retried_after": self.retried_after,
                "replays": self.replays, "padded_rows": self.padded_rows}


@contextmanager
def _no_collection() -> Iterator[None]:
    """Collect the process's dead reference cycles now and none until the block ends. A collection inside a
    capture would free CUDA objects of an engine shut down before (its graphs and their memory pool, events,
    pinned buffers) in the capturing thread, which CUDA's global capture mode forbids: the capture is then
    invalidated (seen on an H100, 2026-12-05). SGLang and vLLM hold the collector off around capture too."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs:
    """Static decode buffers and, on CUDA, one captured graph per bucket."""

    def __init__(self, forward: StepForward, cache_engine: CacheEngine, layer_of: Dict[int, int],
                 config: GraphConfig, step_context: Callable[[], ContextManager]) -> None:
        """`step_context()`: what the runner wraps every forward in (no_grad, our attention as the model's)."""
        device = cache_engine.kv.device
        capture = config.capture
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {device}")
        self.forward = forward
        self.step_context = step_context
        self.device = device
        self.stats = GraphStats(capture)
        if capture:
            backend = kernel_backend(cache_engine.kv)
            if backend != "triton":   # the other kernels check and plan each step on the host: not capturable
                self.stats.error = (f"CUDA graphs need the Triton kernels; the attention kernels here are "
                                    f"{backend!r} (PAGED_BACKEND_KERNELS): decode steps run eagerly")
                logger.warning(self.stats.error)
                return
        self.block_size = cache_engine.block_size
        self.max_blocks = -(-config.max_model_len // self.block_size)
        self.buckets = sorted(config.buckets) if config.buckets else graph_buckets(config.max_num_seqs)
        largest = self.buckets[-1]
        i64, i32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(largest, **i64)
        self.positions = torch.zeros(largest, **i64)
        self.slot_mapping = torch.full((largest,), -1, **i64)
        self.block_tables = torch.zeros(largest, self.max_blocks, **i32)
        self.context_lens = torch.ones(largest, **i32)
        self.query_start_loc = torch.arange(largest + 1, **i32)
        self.sample_indices = torch.arange(largest, **i64)
        self.metadata = {b: AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b], context_lens=self.context_lens[:b],
            query_start_loc=self.query_start_loc[:b + 1], block_size=self.block_size, kv_caches=cache_engine.kv_caches,
            layer_of=layer_of, kv_scales=cache_engine.kv_scales) for b in self.buckets}
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()
        else:
            self.stats.buckets = list(self.buckets)

    # ---- which steps replay ---------------------------------------------------------------------------------
    def bucket_for(self, inputs: StepInputs) -> Optional[int]:
        """The bucket a step replays in, or None when it runs eagerly (decided from host-known shapes only)."""
        if not self.stats.buckets or inputs.lora is not None:
            return None
        n = inputs.num_tokens
        if n == 0 or inputs.context_lens.shape[0] != n or inputs.sample_indices.shape[0] != n:
            return None   # not one token per sequence, or a row that does not sample (a prefill chunk of one)
        if n > self.stats.buckets[-1] or inputs.block_tables.shape[1] > self.max_blocks:
            return None
        for bucket in self.stats.buckets:
            if bucket >= n:
                return bucket
        return None

    # ---- a step ---------------------------------------------------------------------------------------------
    def run(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """The step's logits `[n, vocab]` (a copy: the graph's output is overwritten by the next replay)."""
        n = inputs.num_tokens
        self._load(inputs, n, bucket)
        self.stats.replays += 1
        self.stats.padded_rows += bucket - n
        if bucket in self.graphs:
            with torch.cuda.device(self.device):   # the graph's device's current stream, whichever is current
                self.graphs[bucket].replay()
            return self.outputs[bucket][:n].clone()
        return self._forward(bucket)[:n]

    def _load(self, inputs: StepInputs, n: int, bucket: int) -> None:
        """Copy the step into rows `:n` of the buffers and make rows `n:bucket` padding."""
        width = inputs.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(inputs.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)
        if inputs.device_fill is not None:   # the tokens the previous step left on the device
            inputs.device_fill.apply(self.input_ids)
        if bucket > n:
            self._pad(n, bucket)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.context_lens[start:end] = 1
        self.block_tables[start:end, 0] = 0

    def _forward(self, bucket: int) -> torch.Tensor:
        self.metadata[bucket].plans.clear()   # a plan (not Triton's) is built from the step's values, once per step
        with ExitStack() as stack:
            stack.enter_context(self.step_context())
            stack.enter_context(attention_context(self.metadata[bucket]))
            return self.forward(self.input_ids[:bucket], self.positions[:bucket], self.sample_indices[:bucket])

    # ---- capture --------------------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        """Capture every bucket, largest first, into one memory pool; a failed attempt is retried once from the
        start, and after a second failure no graph is kept and every step runs eagerly (the reason is in
        `stats.error` and the log)."""
        began = time.perf_counter()
        for attempt in (1, 2):
            try:
                with torch.cuda.device(self.device), _no_collection():   # the cache's device: streams, pool, graphs
                    pool = torch.cuda.graph_pool_handle()
                    for bucket in reversed(self.buckets):
                        self._capture(bucket, pool)
                break
            except Exception as exc:  # noqa: BLE001 - a model whose forward cannot be captured still runs eagerly
                self.graphs.clear()
                self.outputs.clear()
                torch.cuda.synchronize(self.device)
                reason = f"{type(exc).__name__}: {exc}"[:2000]
                if attempt == 1:
                    self.stats.retried_after = reason
                    logger.warning("CUDA graph capture failed, trying once more: %s", reason)
                    continue
                self.stats.error = reason
                logger.warning("CUDA graph capture failed; decode steps run eagerly: %s", reason)
                return
        self.stats.buckets = list(self.buckets)
        self.stats.seconds = time.perf_counter() - began
        logger.info("captured CUDA graphs for %d decode batch sizes in %.1f s", len(self.buckets), self.stats.seconds)

    def _capture(self, bucket: int, pool) -> None:
        self._pad(0, bucket)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[bucket] = self._forward(bucket)
        self.graphs[bucket] = graph
