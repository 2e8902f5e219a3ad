"""Benchmark 2, throughput at equal KV memory: the same trace, model, dtype and KV budget through our paged
engine, the reservation baselines (same engine, contiguous reservations), HF static `generate` and
transformers' continuous batching, in interleaved repetitions (A, B, C, A, B, C, ...); each row is the
median with its range, each ratio the median of the ratios paired within a round.

A compact KV cache (`kv_cache_dtype`) runs in the same rounds as rows of its own, at the same KV bytes as
the model-dtype cache, and is never part of the equal-precision comparison.

Our engine runs twice per round: eagerly (`paged`, the forward transformers' modules run op by op) and compiled
(`paged-compiled`, `compile="blocking"`: the forward compiled per bucket before the timed run, as `paged-backend
serve --compile` serves), each with its own ratios against every other system.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from paged_backend.benchmarks.paper.engine_runs import (SYSTEM_LABELS, build_engine, build_kv_dtype_engine, kv_cache_bytes, kv_cache_dtype_refusal,
                          load_bench_model, release, run_trace, set_threads, warm_up)
from paged_backend.benchmarks.paper.hf_baselines import run_hf_continuous, run_hf_static, warm_up_hf
from paged_backend.benchmarks.harness.provenance import load_average
from paged_backend.benchmarks.harness.repeat import run_interleaved
from paged_backend.benchmarks.harness.report import BenchmarkSpec
from paged_backend.benchmarks.paper.throughput_rows import (COMPILED, KV_PREFIX, check_throughput, summarize,
                                                            throughput_table)
from paged_backend.benchmarks.harness.workloads import MAX_TOTAL_TOKENS, Trace, make_trace

ENGINE_SYSTEMS = ("paged", COMPILED, "oracle", "pow2", "max")
HF_SYSTEMS = ("hf-static", "hf-continuous")
LABELS = {**SYSTEM_LABELS, COMPILED: "paged (ours), compiled", "hf-static": "HF generate, static batches",
          "hf-continuous": "HF continuous batching"}
# vLLM's paper (Figure 12, ShareGPT, OPT-13B): sustained request rate vs Orca baselines at similar latency.
PAPER_NOTE = ("paper Fig. 12a (ShareGPT, OPT-13B): vLLM sustains 1.7x-2.7x the request rate of Orca (Oracle) "
              "and 2.7x-8x that of Orca (Max); up to 22x FasterTransformer")
MISSING_RECOMPUTED = "EngineStats.num_recomputed_tokens"


@dataclass
class ThroughputConfig:
    """Defaults are the anchor workload (see SIZES)."""

    model: str = "smollm2"
    workload: str = "sharegpt"
    num_requests: int = 64
    max_prompt_len: Optional[int] = 256
    max_output_len: Optional[int] = 128
    kv_slots: int = 3072
    block_size: int = 16
    max_model_len: Optional[int] = None   # None: prompt cap + output cap when both are set, else 2048
    systems: Tuple[str, ...] = ENGINE_SYSTEMS + HF_SYSTEMS
    kv_cache_dtypes: Tuple[str, ...] = ("bfloat16", "fp8_e4m3")
    repetitions: int = 3
    allocator: str = "first-fit"
    seed: int = 0
    threads: Optional[int] = 2
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.systems, self.kv_cache_dtypes = tuple(self.systems), tuple(self.kv_cache_dtypes)
        unknown = set(self.systems) - set(ENGINE_SYSTEMS + HF_SYSTEMS)
        if unknown:
            raise ValueError(f"unknown systems {sorted(unknown)}; use {ENGINE_SYSTEMS + HF_SYSTEMS}")
        if self.repetitions < 1:
            raise ValueError(f"repetitions must be >= 1, got {self.repetitions}")
        if self.kv_cache_dtypes and "paged" not in self.systems:
            raise ValueError("kv_cache_dtype rows are compared with the paged engine: keep 'paged' in systems")

    def context_limit(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        if self.max_prompt_len and self.max_output_len:
            return self.max_prompt_len + self.max_output_len
        return MAX_TOTAL_TOKENS


# The anchor: 64 ShareGPT requests, prompts cut to 256 tokens and outputs capped at 128, 192 blocks of 16 slots
# (135 MiB of KV for smollm2 in float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes = 45 KiB per token).
ANCHOR = {"model": "smollm2", "workload": "sharegpt", "num_requests": 64, "max_prompt_len": 256,
          "max_output_len": 128, "kv_slots": 3072, "block_size": 16, "repetitions": 3, "threads": 2,
          "dtype": "float32", "kv_cache_dtypes": ("bfloat16", "fp8_e4m3")}
# Small enough for a smoke test, tight enough in KV that the paged engine preempts.
QUICK = {"model": "tiny-llama", "num_requests": 6, "max_prompt_len": 48, "max_output_len": 24, "kv_slots": 192,
         "repetitions": 2, "threads": 1}
SIZES = {"quick": QUICK, "anchor": ANCHOR}


@dataclass
class _Context:
    model: object
    tokenizer: object
    trace: Trace
    config: ThroughputConfig
    kv_bytes: int


def _run_engine(engine, ctx: _Context, system: str, kv_slots: int) -> dict:
    """Our engine through the trace, stepped from this thread: overlapped, as a user's thread steps it (its
    forwards and draws run on the compute thread; stepped from the compute thread itself, every step would run
    inline)."""
    from paged_backend.worker.compute_thread import on_compute_thread

    try:
        warm_up(engine, list(ctx.trace.requests[0].prompt_token_ids))
        run = run_trace(engine, ctx.trace, system, kv_slots)
    finally:
        release(engine)
    row = run.as_dict()
    row["_digests"] = run.digests
    row["overlapped"] = engine.overlapped and not on_compute_thread()
    if engine.runner.compiled is not None:   # its buckets, and how many steps none of them took
        row["compiled"] = engine.runner.compiled.stats.as_dict()
    return row


def _run_hf(system: str, ctx: _Context) -> dict:
    """transformers' baseline through the trace (on the compute thread: it shares our engines' OpenMP team)."""
    runner = run_hf_static if system == "hf-static" else run_hf_continuous
    if system == "hf-static":
        warm_up_hf(ctx.model, ctx.tokenizer, list(ctx.trace.requests[0].prompt_token_ids))
    run = runner(ctx.model, ctx.tokenizer, ctx.trace, ctx.config.kv_slots)
    return {**run.as_dict(), "_digests": run.digests}


def _run_system(system: str, ctx: _Context) -> dict:
    """One timed pass of the trace through one system."""
    from paged_backend.worker.compute_thread import run_on_compute_thread

    c = ctx.config
    if system in HF_SYSTEMS:
        return run_on_compute_thread(_run_hf, system, ctx)
    if system.startswith(KV_PREFIX):
        engine = build_kv_dtype_engine(ctx.model, ctx.tokenizer, system[len(KV_PREFIX):], ctx.kv_bytes, c.block_size,
                                       c.context_limit())
        return _run_engine(engine, ctx, system, engine.kv_size.num_blocks * c.block_size)
    options = {"compile": "blocking"} if system == COMPILED else {}
    engine = build_engine(ctx.model, ctx.tokenizer, "paged" if system == COMPILED else system, c.kv_slots,
                          c.block_size, c.context_limit(), allocator=c.allocator, **options)
    return _run_engine(engine, ctx, system, c.kv_slots)


def kv_dtype_systems(dtypes: Tuple[str, ...]) -> Tuple[List[str], Dict[str, str]]:
    """The kv_cache_dtype systems the engine accepts, and why each other one is skipped."""
    accepted, skipped = [], {}
    for dtype in dtypes:
        refusal = kv_cache_dtype_refusal(dtype)
        if refusal is None:
            accepted.append(KV_PREFIX + dtype)
        else:
            skipped[dtype] = f"skipped: the engine refuses kv_cache_dtype={dtype!r} ({refusal})"
    return accepted, skipped


def _budget_bytes(model, tokenizer, config: ThroughputConfig) -> int:
    """Bytes of the model-dtype paged cache of `kv_slots` slots: the budget the compact-KV rows get."""
    engine = build_engine(model, tokenizer, "paged", config.kv_slots, config.block_size, config.context_limit())
    try:
        return kv_cache_bytes(engine)
    finally:
        release(engine)


def run_throughput(config: ThroughputConfig) -> dict:
    import torch

    from paged_backend.worker.compute_thread import run_on_compute_thread

    threads = set_threads(config.threads)
    model, tokenizer = run_on_compute_thread(load_bench_model, config.model, getattr(torch, config.dtype))
    trace = make_trace(config.workload, tokenizer, config.num_requests, config.seed, config.max_prompt_len,
                       config.max_output_len)
    longest = max(r.total_len for r in trace.requests)
    if longest > config.context_limit():
        raise ValueError(f"a request needs {longest} tokens; the context limit is {config.context_limit()}")
    kv_systems, kv_skipped = kv_dtype_systems(config.kv_cache_dtypes)
    ctx = _Context(model, tokenizer, trace, config, _budget_bytes(model, tokenizer, config))

    def one(system: str, rep: int) -> dict:
        before = load_average()
        row = _run_system(system, ctx)
        row.update(load_before=before, load_after=load_average())
        print(f"  round {rep + 1}/{config.repetitions} {system}: {row['output_tokens_per_s']:.1f} output tok/s, "
              f"{row['wall_s']:.0f} s", flush=True)
        return row

    runs = run_interleaved(list(config.systems) + kv_systems, config.repetitions, one)
    trace_tokens = sum(r.total_len for r in trace.requests)
    missing = [MISSING_RECOMPUTED] if any("recomputed_tokens" in r and r["recomputed_tokens"] is None
                                          for r in runs) else []
    return {"benchmark": "throughput", "config": asdict(config), "trace": trace.summary(),
            "context_limit": config.context_limit(), "kv_bytes": ctx.kv_bytes, "kv_mib": ctx.kv_bytes / 2**20,
            "conditions": {"threads": threads}, "order": [[r["repetition"], r["system"]] for r in runs],
            "rows": summarize(runs, LABELS, trace_tokens), "runs": [{k: v for k, v in r.items() if k != "_digests"} for r in runs],
            "kv_cache_dtype_skipped": kv_skipped, "missing_stats": missing, "paper": PAPER_NOTE}


SPEC = BenchmarkSpec("throughput", ThroughputConfig, run_throughput, check_throughput, throughput_table,
                     "plot_throughput", SIZES, documented_size="anchor", on_compute_thread=False)
