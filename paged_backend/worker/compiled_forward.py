"""The model's step forward under `torch.compile` (inductor), per shape bucket, eager until a bucket is compiled.

A decode step on the CPU at small batches is hundreds of small operators per token (30 layers of norms, rotary,
activation products and residual adds around the linear layers), each dispatched one by one in eager mode.
Compiling the unmodified Hugging Face forward fuses them into a few loops per layer; attention stays our kernel
as one opaque operator (`attention_op.py`). Like CUDA graphs on a GPU the compiled code is kept per bucket:

- `single`: one new token (batch-1 decode), every shape static;
- `batch`: two or more new tokens (decode batches, prefill chunks, mixed steps), the token count and the count
  of sampled rows symbolic (at least 2: a step that samples one row samples it twice and keeps the first).

`CompiledForward` compiles the buckets when it is created: in a background thread (`compile="background"`,
the default of `compile=True`: steps run eagerly until their bucket is ready, so a server answers at once), or
before returning (`compile="blocking"`). Warm-up runs use a scratch KV cache of a few blocks, never the engine's.
The step thread only ever runs code compiled before (`torch._dynamo.run`): a step whose shape no compiled
graph accepts runs eagerly instead of compiling inside a step.

Compiled code is cached across runs by inductor's on-disk caches (FX graph and AOTAutograd caches) under
`$PAGED_BACKEND_CACHE/inductor` (unless `TORCHINDUCTOR_CACHE_DIR` is set): a later start re-traces the model
(seconds) and loads the compiled kernels instead of generating and building them (minutes on 2 cores).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Optional

import torch

from paged_backend.worker.attention import AttentionMetadata, attention_context, current_metadata
from paged_backend.worker.attention_op import compiled_attention_step
from paged_backend.worker.cache_engine import CacheEngine
from paged_backend.worker.linear_fusion import FuseSharedInputLinears
from paged_backend.worker.trace_exclusion import TRACE_EXCLUSION

logger = logging.getLogger(__name__)

BUCKETS = ("single", "batch")
# Inductor options: loops shorter than this many elements run on one thread (a 576-wide norm or a 1536-wide
# activation product at batch 1 is not worth waking a thread team for; a parallel region per small loop costs
# more than the loop when the cores are shared); the graph's wrapper in C++ (`cpp_wrapper`): a decode step's
# few hundred kernel and matmul calls are made from C++ rather than from a generated Python function (smollm2
# batch-1 decode 29.3 -> 26.5 ms/token; the first compilation takes about 3 minutes instead of 1); no size, stride
# or scalar checks in the wrapper on each call (`size_asserts`, `scalar_asserts`): dynamo's guards pick a bucket by
# the step's input shapes, parameters keep theirs while an engine runs and the operators' outputs are ours (about
# 400 checks per smollm2 decode step, each reading metadata the step's weights had evicted from the caches:
# 0.2-0.3 ms of a 17-20 ms float32 batch-1 step on a 2-core AVX-512 EPYC, docs/compilation.md).
INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 16384, "cpp_wrapper": True, "size_asserts": False,
                    "scalar_asserts": False}


# Dynamo options while a bucket is traced: the model's parameters and buffers become attributes of the traced graph
# (`install_free_tensors`) rather than inputs of every call. As inputs, the code dynamo runs before each compiled
# call fetched all of them through the modules' attribute chains (smollm2: 272 parameters, about 0.45 ms of a
# 21 ms bfloat16 batch-1 decode step on 2 cores, 0.8 -> 0.35 ms from the call to the compiled graph's start); as
# attributes AOTAutograd collects them once, when it compiles. The compiled code reads the same tensors (no copy).
DYNAMO_OPTIONS = {"install_free_tensors": True}


def skip_model_guards(guard_entries) -> list:
    """Dynamo's guard filter for the step forward: keep the guards on the step's inputs (which bucket a step
    takes) and on global state, drop those on the model's attributes (parameters, buffers, module flags, config):
    a decode step checked about 300 of them, 0.7 ms of a 17 ms bfloat16 step on 2 cores. The engine never replaces
    or reshapes a parameter, changes a module's mode or edits the config while it runs (LoRA, which chooses
    weights per step, is refused with compile); in-place updates of weights need no guard, the compiled code reads
    the tensors it is given at each call."""
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(guard_entries)


GUARD_FILTER = skip_model_guards

MAX_BATCH_TOKENS = 1 << 20   # the batch bucket's bound on a step's tokens (a larger step runs eagerly)

StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code: $TORCHINDUCTOR_CACHE_DIR when the user set it, else `inductor/` in the
    project's cache dir. Torch writes its own default (a folder under /tmp) into that variable the first time it
    asks, so a value equal to that default is not taken as the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from paged_backend.worker.loader import cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    return str(cache_dir() / "inductor")


def inductor_beside_forwards(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None):
    """Inductor as dynamo's backend, with the process's forwards let through while it compiles the traced graph
    (`trace_exclusion.py`: they wait while dynamo traces the model and builds guards)."""
    from torch._inductor.compile_fx import compile_fx

    with TRACE_EXCLUSION.backend_runs():
        return compile_fx(gm, example_inputs, config_patches=options)


def bucket_of(num_tokens: int) -> str:
    return "single" if num_tokens == 1 else "batch"


def eager_forward(model: torch.nn.Module) -> StepForward:
    """The step's forward: the packed row through the HF model, logits of the sampled rows only."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        output = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                       logits_to_keep=sample_indices)
        return output.logits[0]

    return forward


def _own_code(function: StepForward) -> StepForward:
    """`function` with a code object of its own: dynamo keeps compiled graphs on the code object (at most
    `recompile_limit` per code object), so each engine's two buckets get their own list and die with it."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


@dataclass
class BucketState:
    """One bucket's compilation: whether it is ready, how long it took, why it failed."""

    ready: bool = False
    seconds: Optional[float] = None
    error: Optional[str] = None
    steps: int = 0            # steps run compiled in this bucket

    def as_dict(self) -> dict:
        return {"ready": self.ready, "seconds": self.seconds, "error": self.error, "steps": self.steps}


@dataclass
class CompileStats:
    mode: str
    cache_dir: str
    buckets: Dict[str, BucketState] = field(default_factory=lambda: {b: BucketState() for b in BUCKETS})
    eager_steps: int = 0      # steps run eagerly because their bucket was not ready
    linear_kernels: int = 0   # linear layers compiled as our kernel's operator (kernel_linear.py)
    streamed_weights: bool = False   # the kernel prefetches weights non-temporally (larger than the caches)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "cache_dir": self.cache_dir, "eager_steps": self.eager_steps,
                "linear_kernels": self.linear_kernels, "streamed_weights": self.streamed_weights,
                "buckets": {name: state.as_dict() for name, state in self.buckets.items()}}


class CompiledForward:
    """A step forward that runs compiled code for buckets that are ready and eager code otherwise."""

    def __init__(self, model: torch.nn.Module, cache_engine: CacheEngine, mode: str,
                 paged_attention: Callable[[], ContextManager]) -> None:
        """`paged_attention()`: the context in which the model calls our attention function (the runner's)."""
        if mode not in ("background", "blocking"):
            raise ValueError(f"CompiledForward mode must be 'background' or 'blocking', got {mode!r}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
        from paged_backend.worker.kernel_linear import stream_kernel_weights, use_linear_kernel

        linear_kernels = use_linear_kernel(model)   # the linear layers our kernel serves on this CPU, when compiled
        streamed = stream_kernel_weights(model) if linear_kernels else False
        self.eager = eager_forward(model)
        self._compiled = torch.compile(_own_code(eager_forward(model)), fullgraph=True,
                                       backend=inductor_beside_forwards,
                                       options={**INDUCTOR_OPTIONS, "guard_filter_fn": GUARD_FILTER,
                                                "post_grad_custom_pre_pass": FuseSharedInputLinears()})
        self._run_only = torch._dynamo.run(self._compiled)
        self._scratch = _ScratchStep(cache_engine)
        self._paged_attention = paged_attention
        self._windows: set = set()   # the sliding windows (None: none) of the model's attention layers, as met
        self.stats = CompileStats(mode, os.environ["TORCHINDUCTOR_CACHE_DIR"], linear_kernels=linear_kernels,
                                  streamed_weights=streamed)
        self._done = threading.Event()
        # Dropped objects that still hold hooks on the model (a LoRA runner in a reference cycle keeps its forward
        # hooks until the collector runs its finalizer) go now: a collection in the middle of a trace would take
        # a hook that the bucket's guards name, and the bucket would fail to compile.
        gc.collect()
        if mode == "blocking":
            self._compile_all()
        else:
            self._thread = threading.Thread(target=self._compile_all, name="paged-backend-compile", daemon=True)
            self._thread.start()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        state = self.stats.buckets[bucket_of(input_ids.shape[0])]
        if not state.ready:
            self.stats.eager_steps += 1
            return self.eager(input_ids, positions, sample_indices)
        state.steps += 1
        keep = sample_indices.shape[0]
        least = 1 if input_ids.shape[0] == 1 else 2   # the rows each bucket was compiled for, at the least
        if keep < least:   # a step that samples fewer (a prefill chunk samples none) computes the last row's too
            padded = torch.full((least,), input_ids.shape[0] - 1, dtype=sample_indices.dtype,
                                device=sample_indices.device)
            padded[:keep] = sample_indices
            sample_indices = padded
        with compiled_attention_step(current_metadata(), self._windows):
            return self._run_only(input_ids, positions, sample_indices)[:keep]

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until every bucket is compiled (or failed); True when done."""
        return self._done.wait(timeout)

    def _compile_all(self) -> None:
        try:
            for bucket in BUCKETS:
                self._compile(bucket)
        finally:
            self._done.set()

    def _compile(self, bucket: str) -> None:
        state = self.stats.buckets[bucket]
        began = time.perf_counter()
        try:
            args, metadata = self._scratch.inputs(bucket)
            with TRACE_EXCLUSION.trace(), torch.no_grad(), attention_context(metadata), self._paged_attention(), \
                    compiled_attention_step(metadata, set()), torch._dynamo.config.patch(DYNAMO_OPTIONS):
                self._compiled(*args)
        except Exception as exc:  # noqa: BLE001 - a bucket that cannot compile stays eager, and says why
            state.error = f"{type(exc).__name__}: {exc}"[:2000]
            logger.warning("compiling the %s bucket failed; its steps run eagerly: %s", bucket, state.error)
            return
        state.seconds = time.perf_counter() - began
        state.ready = True
        logger.info("compiled the %s bucket in %.1f s", bucket, state.seconds)


class _ScratchStep:
    """Synthetic steps over a scratch KV cache of a few blocks, to trace and compile each bucket."""

    def __init__(self, cache_engine: CacheEngine) -> None:
        self.block_size = cache_engine.block_size
        self.device = cache_engine.kv.device
        self.cache = CacheEngine(cache_engine.geometry, cache_engine.block_size, 4, 0, cache_engine.kv.dtype,
                                 self.device)

    def inputs(self, bucket: str):
        """(input_ids, positions, sample_indices) and the attention metadata of a bucket's warm-up step: one
        decode token; or 3 sequences with 1, 1 and 3 new tokens (token and sampled-row counts differ, so the
        two sizes get separate symbols)."""
        query_lens = [1] if bucket == "single" else [1, 1, 3]
        context_lens = [2, 1, 3] if bucket == "batch" else [2]
        num_seqs, tokens = len(query_lens), sum(query_lens)
        i64 = dict(dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(c - q, c, **i64) for c, q in zip(context_lens, query_lens)])
        slots = torch.cat([torch.arange(c - q, c, **i64) + s * self.block_size
                           for s, (c, q) in enumerate(zip(context_lens, query_lens))])
        starts = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32, device=self.device)
        metadata = AttentionMetadata(
            slot_mapping=slots, block_tables=torch.arange(num_seqs, dtype=torch.int32, device=self.device)[:, None],
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device), query_start_loc=starts,
            block_size=self.block_size, kv_caches=self.cache.kv_caches, layer_of={}, kv_scales=self.cache.kv_scales)
        sample_indices = starts[1:].to(torch.long) - 1
        input_ids = torch.zeros(tokens, **i64)
        if bucket == "batch":
            for tensor in (input_ids, positions, sample_indices):
                torch._dynamo.mark_dynamic(tensor, 0, min=2, max=MAX_BATCH_TOKENS)
        return (input_ids, positions, sample_indices), metadata
