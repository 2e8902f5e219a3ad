"""Run a trace through `LLMEngine` as one of the compared systems: paged, or a reservation baseline.

All systems get the same KV budget in token slots: the paged engine as blocks of `block_size`
slots, the reservation baselines as single-slot blocks carved into contiguous runs. Requests are
forced to their trace's output length (greedy, `ignore_eos`, `max_tokens`).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from paged_backend import LLMEngine, SamplingParams

from paged_backend.benchmarks.paper.accounting import KVTally, MemoryLedger
from paged_backend.benchmarks.paper.reservation import POLICIES, ReservationBlockManager, install_reservation
from paged_backend.benchmarks.harness.workloads import MAX_TOTAL_TOKENS, Trace, TraceRequest

SYSTEMS = ("paged",) + POLICIES
SYSTEM_LABELS = {"paged": "paged (ours)", "max": "reserve max len", "pow2": "reserve pow2(output)",
                 "oracle": "reserve true output (oracle)"}


def load_bench_model(name: str, dtype: torch.dtype = torch.float32, context: int = MAX_TOTAL_TOKENS):
    """(model, tokenizer) for a preset; a tiny preset's context is raised to `context` (RoPE has no
    learned positions), so the trace's 2048-token requests fit."""
    from paged_backend.worker.loader import TINY_PRESETS, load_model

    model, tokenizer = load_model(name, dtype=dtype)
    if name in TINY_PRESETS:
        if name != "tiny-llama":
            raise ValueError(f"only tiny-llama (rotary positions) can be stretched to {context} tokens; got {name}")
        model.config.max_position_embeddings = max(context, model.config.max_position_embeddings)
    return model, tokenizer


def load_tokenizer(name: str):
    """The tokenizer of a preset or model directory, without keeping a large model in memory."""
    from paged_backend.worker.loader import PRESETS, load_model

    if name in PRESETS:
        return load_model("tiny-llama")[1]  # every preset uses SmolLM2's tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def auto_threads() -> int:
    """One torch thread when other work loads the machine (multi-threaded small ops then stall on
    each other), every core otherwise."""
    try:
        busy = os.getloadavg()[0] >= 1.0
    except OSError:
        busy = False
    return 1 if busy else (os.cpu_count() or 1)


def set_threads(threads: Optional[int]) -> int:
    """Use `threads` torch threads (None/0: $PAGED_BENCH_THREADS, else `auto_threads()`); returns the count."""
    wanted = threads or int(os.environ.get("PAGED_BENCH_THREADS", "0") or 0) or auto_threads()
    torch.set_num_threads(wanted)
    return torch.get_num_threads()


def build_engine(model, tokenizer, system: str, kv_slots: int, block_size: int = 16,
                 max_model_len: int = MAX_TOTAL_TOKENS, allocator: str = "first-fit", **options) -> LLMEngine:
    """An engine for `system` ("paged", "max", "pow2", "oracle") holding `kv_slots` token slots of KV cache."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; use one of {SYSTEMS}")
    options.setdefault("num_swap_blocks", 0)
    if system != "paged":
        options["enable_prefix_caching"] = False  # a reservation shares nothing, whatever the engine's default
    if system == "paged":
        if kv_slots % block_size:
            raise ValueError(f"kv_slots={kv_slots} is not a multiple of block_size={block_size}")
        return LLMEngine(model, tokenizer, block_size=block_size, num_blocks=kv_slots // block_size,
                         max_model_len=max_model_len, **options)
    engine = LLMEngine(model, tokenizer, block_size=1, num_blocks=kv_slots, max_model_len=max_model_len, **options)
    install_reservation(engine, system, allocator)
    return engine


def kv_cache_dtype_refusal(kv_cache_dtype: str) -> Optional[str]:
    """Why the engine cannot take `kv_cache_dtype=...` (None when it can): the option may not exist yet,
    or may not support that dtype."""
    from paged_backend.config import EngineConfig

    try:
        EngineConfig.from_kwargs(kv_cache_dtype=kv_cache_dtype)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def build_kv_dtype_engine(model, tokenizer, kv_cache_dtype: str, kv_bytes: int, block_size: int = 16,
                          max_model_len: int = MAX_TOTAL_TOKENS) -> LLMEngine:
    """A paged engine whose KV cache is stored as `kv_cache_dtype` in `kv_bytes` bytes (the engine sizes the
    blocks, so a compact dtype holds more tokens in the same memory)."""
    return LLMEngine(model, tokenizer, block_size=block_size, kv_cache_memory=kv_bytes, kv_cache_dtype=kv_cache_dtype,
                     max_model_len=max_model_len, num_swap_blocks=0)


def kv_cache_bytes(engine: LLMEngine) -> int:
    """Bytes of device KV cache the engine holds."""
    return engine.kv_size.bytes_per_block * engine.kv_size.num_blocks


def engine_settings(engine: LLMEngine) -> dict:
    """Every configuration field of an engine (cache, scheduler, parallel, seed) plus its KV size."""
    settings = dataclasses.asdict(engine.config)
    settings["kv_num_blocks"] = engine.kv_size.num_blocks
    settings["kv_bytes"] = kv_cache_bytes(engine)
    settings["max_model_len"] = engine.max_model_len
    settings["block_manager"] = type(engine.block_manager).__name__
    return settings


def recomputed_tokens(stats) -> Optional[int]:
    """`EngineStats.num_recomputed_tokens` (tokens computed again after a preemption), None where the engine
    does not report it yet."""
    value = getattr(stats, "num_recomputed_tokens", None)
    return None if value is None else int(value)


def token_digest(token_ids) -> str:
    """A short fingerprint of one request's output tokens, to compare systems without storing the tokens."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:12]


def forced_params(request: TraceRequest) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=request.output_len)


class DryRunner:
    """Stands in for the model runner: no forward; every sampled token is `token_id` (an ordinary word
    piece, so detokenization behaves as with text). The engine's scheduling, block management and
    sampling still run, so memory behaviour is the engine's own, at scheduling speed."""

    def __init__(self, vocab_size: int, token_id: int) -> None:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token_id {token_id} is outside the vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.token_id = token_id
        self.num_forwards = 0

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> "DryRunner":
        ids = engine.tokenizer(" the", add_special_tokens=False)["input_ids"] if engine.tokenizer else [0]
        return cls(engine.vocab_size, ids[-1])

    def execute(self, inputs) -> torch.Tensor:
        self.num_forwards += 1
        logits = torch.zeros(len(inputs.sample_indices), self.vocab_size)
        logits[:, self.token_id] = 1.0
        return logits

    def shutdown(self) -> None:
        """Nothing to release: a dry runner holds no model and no cache."""


@dataclass
class TraceRun:
    """What one system did with one trace."""

    system: str
    wall_s: float
    num_requests: int
    num_finished: int
    num_failed: int
    output_tokens: int
    prompt_tokens: int
    steps: int
    preemptions: int
    peak_used_blocks: int
    block_size: int
    kv_slots: int
    tally: KVTally
    leaked_blocks: int
    wrong_lengths: int
    recomputed_tokens: Optional[int] = None
    trace_prompt_tokens: int = 0
    digests: List[str] = field(default_factory=list)   # per request, in trace order
    settings: dict = field(default_factory=dict)
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_finished / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        return {"system": self.system, "label": SYSTEM_LABELS.get(self.system, self.system), "wall_s": self.wall_s,
                "num_requests": self.num_requests, "num_finished": self.num_finished, "num_failed": self.num_failed,
                "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens, "steps": self.steps,
                "preemptions": self.preemptions, "peak_used_blocks": self.peak_used_blocks,
                "block_size": self.block_size, "kv_slots": self.kv_slots,
                "requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s,
                "leaked_blocks": self.leaked_blocks, "wrong_lengths": self.wrong_lengths,
                "recomputed_tokens": self.recomputed_tokens,
                "extra_prefill_tokens": self.prompt_tokens - self.trace_prompt_tokens,
                "memory": self.tally.as_dict(), "engine": self.settings, **self.extra}


def leaked_blocks(engine: LLMEngine) -> int:
    """Device blocks still held after every request finished (0 when nothing leaked)."""
    bm = engine.block_manager
    held = bm.num_blocks - bm.get_num_free_blocks()
    if isinstance(bm, ReservationBlockManager):
        held += len(bm.regions)
    return held + len(bm.block_tables) + len(bm.swapped_tables)


def run_trace(engine: LLMEngine, trace: Trace, system: str, kv_slots: int,
              max_seconds: Optional[float] = None) -> TraceRun:
    """Queue the whole trace at once, step to completion, and account for memory every step."""
    before = engine.get_stats()
    ledger = MemoryLedger(engine)
    wanted: Dict[str, int] = {}
    for i, request in enumerate(trace.requests):
        rid = f"{trace.name}-{i}"
        engine.add_request(rid, list(request.prompt_token_ids), forced_params(request))
        wanted[rid] = request.output_len
    finished = failed = output_tokens = wrong = 0
    tokens: Dict[str, List[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            engine.abort_request(list(engine.groups))
            raise TimeoutError(f"{system}: trace not done after {max_seconds:.0f} s")
        for out in engine.step():
            if not out.finished:
                continue
            if out.error is not None:
                failed += 1
                continue
            finished += 1
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            produced = len(out.outputs[0].token_ids)
            output_tokens += produced
            wrong += produced != wanted[out.request_id]
    wall = time.perf_counter() - start
    ledger.detach()
    stats = engine.get_stats()
    recomputed = recomputed_tokens(stats)
    if recomputed is not None:
        recomputed -= recomputed_tokens(before) or 0
    return TraceRun(system, wall, len(trace.requests), finished, failed, output_tokens,
                    stats.num_prompt_tokens - before.num_prompt_tokens, stats.num_steps - before.num_steps,
                    stats.num_preemptions - before.num_preemptions, stats.peak_used_blocks,
                    engine.block_manager.block_size, kv_slots, ledger.tally, leaked_blocks(engine), wrong,
                    recomputed, sum(r.prompt_len for r in trace.requests),
                    [token_digest(tokens.get(rid, [])) for rid in wanted], engine_settings(engine))


def release(engine: Optional[LLMEngine]) -> None:
    """Drop an engine's KV cache before building the next one."""
    if engine is not None:
        engine.shutdown()
    gc.collect()


def warm_up(engine: LLMEngine, prompt_ids: List[int], tokens: int = 4) -> None:
    """One short request through the engine so first-call costs do not land in a timed run."""
    engine.add_request("warmup", list(prompt_ids), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens))
    while engine.has_unfinished_requests():
        engine.step()
