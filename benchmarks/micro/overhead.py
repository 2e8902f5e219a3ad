"""Benchmark 5, engine overhead: the share of a decode step's wall time spent outside the model forward
(scheduling, block management, input preparation, sampling, output bookkeeping) at 1, 64 and 256
running sequences; then the engine's own time per step with stand-in runners (host_overhead.py): with ready
logits (the whole host time, and where it goes) and with a runner that sleeps D ms (standing for a device),
with and without overlapped scheduling.

Phases are timed with `perf_counter` by wrapping the engine's own methods for the duration of the
measurement; nothing the step does changes. The forward's paged-attention calls (cache write and
attention through block tables) are timed too, as a part of the forward. The model-forward rows run without
overlapped scheduling, so that every phase runs in the timed thread.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from dataclasses import asdict, dataclass
from typing import Iterator, List, Optional, Tuple

from paged_backend import LLMEngine, SamplingParams

from paged_backend.benchmarks.paper.engine_runs import leaked_blocks, load_bench_model, release, set_threads
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table, percent
from paged_backend.benchmarks.harness.workloads import make_trace
from paged_backend.benchmarks.micro.host_overhead import (HOST_PHASES, ExclusiveTimer, has_overlap, host_headers,
                                                          host_table, measure_host, phase_rows, wrapped_methods)

PHASES = ("schedule", "block_manager", "prepare_inputs", "forward", "attention", "sampling", "bookkeeping", "other")
PAPER_NOTE = ("the paper gives no CPU-side step breakdown; its Fig. 18a reports the PagedAttention kernel "
              "20-26% slower than FasterTransformer's contiguous kernel, an overhead inside the attention op")


@dataclass
class OverheadConfig:
    model: str = "smollm2"
    batch_sizes: Tuple[int, ...] = (1, 64, 256)
    prompt_len: int = 32
    decode_steps: int = 8
    block_size: int = 16
    seed: int = 0
    threads: Optional[int] = None
    host_steps: int = 30        # stand-in runners: decode steps timed per measurement (median reported)
    device_ms: float = 25.0     # the sleeping runner's time per forward


QUICK = {"model": "tiny-llama", "batch_sizes": (1, 8), "decode_steps": 3, "host_steps": 4, "device_ms": 5.0}


@contextlib.contextmanager
def instrumented(engine: LLMEngine, timer: ExclusiveTimer) -> Iterator[None]:
    """Time the phases of `engine.step` by wrapping the methods it calls; restores them afterwards."""
    import paged_backend.engine.llm_engine as engine_module
    from paged_backend import kernels

    bm = engine.block_manager
    patches = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "execute", "forward"),
               (engine.sampler, "sample", "sampling"), (engine.sampler, "sample_batch", "sampling"),
               (engine.sampler, "sample_later", "sampling"),
               (engine.tokens, "process", "bookkeeping"), (engine.tokens, "launch", "bookkeeping"),
               (engine_module, "prepare_inputs", "prepare_inputs"), (engine, "_step_inputs", "prepare_inputs"),
               (kernels, "attend_and_cache", "attention"), (kernels, "plan_attention", "attention")]
    patches += [(bm, name, "block_manager") for name in ("can_allocate", "allocate", "can_append_slots",
                                                         "append_slots", "append_decode_slots", "free", "fork",
                                                         "mark_computed")]
    with wrapped_methods([(obj, name, phase) for obj, name, phase in patches if hasattr(obj, name)], timer):
        yield


def _prompts(tokenizer, count: int, length: int, seed: int) -> List[List[int]]:
    trace = make_trace("sharegpt", tokenizer, min(count, 64), seed)
    ids = [t for r in trace.requests for t in r.prompt_token_ids]
    rng = random.Random(seed)
    return [[ids[(rng.randrange(len(ids)) + j) % len(ids)] for j in range(length)] for _ in range(count)]


def measure_batch(model, tokenizer, batch: int, config: OverheadConfig) -> dict:
    """Bring `batch` sequences to decoding, then time `decode_steps` steps phase by phase."""
    prefill_steps = -(-batch * config.prompt_len // 2048) + 1
    max_tokens = prefill_steps + config.decode_steps + 2
    blocks = batch * (-(-(config.prompt_len + max_tokens) // config.block_size) + 1) + 8
    sync = {"async_scheduling": False} if has_overlap() else {}   # every phase in this thread
    engine = LLMEngine(model, tokenizer, block_size=config.block_size, num_blocks=blocks, num_swap_blocks=0,
                       max_num_seqs=max(256, batch), max_num_batched_tokens=max(2048, batch), seed=config.seed,
                       **sync)
    try:
        for i, prompt in enumerate(_prompts(tokenizer, batch, config.prompt_len, config.seed)):
            engine.add_request(f"o{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
        scheduler = engine.scheduler
        while any(s.num_computed_tokens < s.prompt_len for g in itertools.chain(scheduler.waiting, scheduler.running)
                  for s in g.seqs):
            engine.step()
        timer = ExclusiveTimer()
        total = 0.0
        with instrumented(engine, timer):
            for _ in range(config.decode_steps):
                start = time.perf_counter()
                engine.step()
                total += time.perf_counter() - start
        running = engine.get_stats().num_running
        engine.abort_request(list(engine.groups))
        leaked = leaked_blocks(engine)
    finally:
        release(engine)
    s = timer.seconds
    steps = config.decode_steps
    phases = {name: s[name] for name in PHASES if name != "other"}
    phases["other"] = total - sum(phases.values())
    forward = s["forward"] + s["attention"]
    return {"batch": batch, "running": running, "step_ms": 1000 * total / steps,
            "phase_ms": {k: 1000 * v / steps for k, v in phases.items()}, "forward_ms": 1000 * forward / steps,
            "outside_forward_share": 1 - forward / total if total else 0.0,
            "attention_share_of_forward": s["attention"] / forward if forward else 0.0,
            "phase_calls": {name: timer.calls[name] for name in PHASES if name != "other"},
            "leaked_blocks": leaked}


def run_overhead(config: OverheadConfig) -> dict:
    from paged_backend.worker.compute_thread import run_on_compute_thread

    threads = set_threads(config.threads)
    # the model's torch work on the compute thread; the stand-in rows step overlapped engines from here
    model, tokenizer = run_on_compute_thread(load_bench_model, config.model)
    rows = [run_on_compute_thread(measure_batch, model, tokenizer, batch, config) for batch in config.batch_sizes]
    host = [measure_host(model, tokenizer, _prompts(tokenizer, batch, config.prompt_len, config.seed), config)
            for batch in config.batch_sizes]
    return {"benchmark": "overhead", "config": asdict(config), "conditions": {"threads": threads},
            "runs": rows, "host": host, "overlap": has_overlap(), "paper": PAPER_NOTE}


def overhead_table(result: dict) -> str:
    headers = ["running seqs", "step ms", "forward ms", "outside forward", "schedule", "block mgr", "prepare",
               "sampling", "bookkeeping", "other", "attention in fwd"]
    rows = []
    for r in result["runs"]:
        p = r["phase_ms"]
        rows.append([r["running"], f"{r['step_ms']:.1f}", f"{r['forward_ms']:.1f}", percent(r["outside_forward_share"]),
                     f"{p['schedule']:.2f}", f"{p['block_manager']:.2f}", f"{p['prepare_inputs']:.2f}",
                     f"{p['sampling']:.2f}", f"{p['bookkeeping']:.2f}", f"{p['other']:.2f}",
                     percent(r["attention_share_of_forward"])])
    c = result["config"]
    title = (f"Engine overhead per decode step ({c['model']}, prompts of {c['prompt_len']} tokens, "
             f"{c['decode_steps']} steps averaged, {result['conditions']['torch_threads']} threads; phases in ms)")
    tables = [format_table(headers, rows, title)]
    if result.get("host"):
        d = c.get("device_ms", 25.0)
        tables.append(format_table(
            host_headers(d), host_table(result["host"], c),
            f"The engine alone: stand-in runners ({c['model']}'s tokenizer, greedy, median of {c['host_steps']} decode "
            f"steps); ready logits, and a runner that sleeps D ms (step time minus D), without and with overlapped "
            f"scheduling{'' if result.get('overlap') else ' (this engine has none: -)'}"))
        tables.append(format_table(["running seqs"] + list(HOST_PHASES), phase_rows(result["host"]),
                                   "Where the ready-logits step's host time goes, without overlap (ms per step)"))
    return "\n\n".join(tables)


def check_overhead(result: dict) -> List[str]:
    problems = []
    for r in result["runs"]:
        if r["running"] != r["batch"]:
            problems.append(f"batch {r['batch']}: {r['running']} sequences were running")
        if r["leaked_blocks"]:
            problems.append(f"batch {r['batch']}: {r['leaked_blocks']} KV blocks leaked")
        if not 0.0 < r["outside_forward_share"] < 1.0:
            problems.append(f"batch {r['batch']}: outside-forward share {r['outside_forward_share']} out of range")
        never = [name for name, calls in r["phase_calls"].items() if not calls]
        if never:
            problems.append(f"batch {r['batch']}: no call was timed for {', '.join(never)}: the instrumentation no "
                            f"longer matches what the engine's step calls, so those phases would read as free")
    for r in result.get("host", []):
        if r["running"] != r["batch"]:
            problems.append(f"stand-in batch {r['batch']}: {r['running']} sequences were running")
        never = [name for name, calls in r["phase_calls"].items() if not calls and name != "block_manager"]
        if never:
            problems.append(f"stand-in batch {r['batch']}: no call was timed for {', '.join(never)}")
    return problems


# The documented record runs on 2 torch threads (both cores of the reference machine), not a guess from the load.
SIZES = {"quick": QUICK, "full": {"threads": 2}}
SPEC = BenchmarkSpec("overhead", OverheadConfig, run_overhead, check_overhead, overhead_table, "plot_overhead",
                     SIZES, documented_size="full", on_compute_thread=False)
