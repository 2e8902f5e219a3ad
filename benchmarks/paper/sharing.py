"""Benchmark 3, sharing (the paper's Figures 15-17): KV blocks saved by parallel sampling, beam search
and a shared few-shot prefix, measured on the engine's own block tables and stats.

Every step the ledger counts the blocks the running sequences would hold without sharing (each
sequence's own table length) and the distinct physical blocks they actually hold; the saving is
1 - physical / logical over the run, plus the same at the peak and the engine's `peak_used_blocks`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

from paged_backend import LLMEngine, SamplingParams

from paged_backend.benchmarks.paper.accounting import StepObserver
from paged_backend.benchmarks.paper.engine_runs import build_engine, leaked_blocks, load_bench_model, release, set_threads
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table, percent
from paged_backend.benchmarks.paper.translation import few_shot_prefix
from paged_backend.benchmarks.harness.workloads import MAX_TOTAL_TOKENS, Trace, make_trace

# The paper's sections 6.3 (OPT-13B, memory saved by sharing) and 6.4 (shared prefix).
PAPER_SAVINGS = {"parallel": "6.1-9.8% (Alpaca), 16.2-30.5% (ShareGPT)",
                 "beam": "37.6-55.2% (Alpaca), 44.3-66.3% (ShareGPT)",
                 "prefix": "throughput 1.67x (1-shot, 80 tokens) and 3.58x (5-shot, 341 tokens) that of Orca (Oracle), "
                           "LLaMA-13B on WMT16 En-De (Figure 16)"}


@dataclass
class SharingConfig:
    model: str = "smollm2"
    workload: str = "alpaca"
    num_requests: int = 16
    parallel_n: Tuple[int, ...] = (2, 4, 6)
    beam_widths: Tuple[int, ...] = (2, 4, 6)
    prefix_shots: Tuple[int, ...] = (1, 5)
    prefix_requests: int = 16
    prefix_output_len: int = 24
    kv_slots: int = 16384
    block_size: int = 16
    seed: int = 0
    threads: Optional[int] = None
    extra: dict = field(default_factory=dict)


QUICK = {"model": "tiny-llama", "num_requests": 4, "parallel_n": (2, 4), "beam_widths": (2, 4),
         "prefix_shots": (1,), "prefix_requests": 6, "prefix_output_len": 8, "kv_slots": 8192}


class SharingLedger(StepObserver):
    """Per step: blocks the running sequences' tables span (logical) and distinct blocks they hold (physical)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.logical = self.physical = self.peak_logical = self.peak_physical = self.steps = 0
        super().__init__(engine)

    def record(self) -> None:
        tables = self.engine.block_manager.block_tables
        held = [tables[s.seq_id] for g in self.engine.scheduler.running
                for s in g.unfinished_seqs() if s.seq_id in tables]
        logical = sum(len(t) for t in held)
        physical = len({b for t in held for b in t})
        self.logical += logical
        self.physical += physical
        self.peak_logical = max(self.peak_logical, logical)
        self.peak_physical = max(self.peak_physical, physical)
        self.steps += 1

    def result(self) -> dict:
        return {"logical_block_steps": self.logical, "physical_block_steps": self.physical,
                "saving": 1 - self.physical / self.logical if self.logical else 0.0,
                "peak_logical_blocks": self.peak_logical, "peak_physical_blocks": self.peak_physical,
                "peak_saving": 1 - self.peak_physical / self.peak_logical if self.peak_logical else 0.0,
                "steps": self.steps}


def _engine(model, tokenizer, config: SharingConfig, prefix_caching: bool = False) -> LLMEngine:
    return LLMEngine(model, tokenizer, block_size=config.block_size, num_blocks=config.kv_slots // config.block_size,
                     enable_prefix_caching=prefix_caching, seed=config.seed)


def _drain(engine: LLMEngine) -> Tuple[int, int]:
    """Step until idle; returns (finished requests, output tokens of their completions)."""
    finished = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.error is None:
                finished += 1
                tokens += sum(len(c.token_ids) for c in out.outputs)
    return finished, tokens


def _run(engine: LLMEngine, prompts: List[List[int]], params: List[SamplingParams], warm_first: bool = False) -> dict:
    """Run requests with the sharing ledger attached; `warm_first` computes request 0's prompt before the
    others arrive, so they can find its prefix in the cache (as requests arriving over time would)."""
    ledger = SharingLedger(engine)
    start = time.perf_counter()
    rest = list(range(len(prompts)))
    if warm_first and rest:
        engine.add_request("r0", prompts[0], params[0])
        engine.step()
        rest = rest[1:]
    for i in rest:
        engine.add_request(f"r{i}", prompts[i], params[i])
    finished, tokens = _drain(engine)
    wall = time.perf_counter() - start
    ledger.detach()
    stats = engine.get_stats()
    return {**ledger.result(), "wall_s": wall, "num_requests": len(prompts), "num_finished": finished,
            "output_tokens": tokens, "peak_used_blocks": stats.peak_used_blocks,
            "peak_used_slots": stats.peak_used_blocks * stats.block_size,
            "copy_on_write": stats.num_copy_on_write, "preemptions": stats.num_preemptions,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "cached_prefill_tokens": stats.num_cached_prefill_tokens, "prompt_tokens_total": sum(map(len, prompts)),
            "leaked_blocks": leaked_blocks(engine)}  # parked prefix-cache blocks count as free


def run_branching(model, tokenizer, trace: Trace, config: SharingConfig) -> List[dict]:
    """Parallel sampling with n samples and beam search with width k, on the same prompts and lengths."""
    rows = []
    prompts = [list(r.prompt_token_ids) for r in trace.requests]
    cases = [("parallel", n) for n in config.parallel_n] + [("beam", k) for k in config.beam_widths]
    for kind, k in cases:
        if kind == "parallel":
            params = [SamplingParams(n=k, temperature=1.0, seed=config.seed + i, ignore_eos=True,
                                     max_tokens=r.output_len) for i, r in enumerate(trace.requests)]
        else:
            params = [SamplingParams(beam_width=k, temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
                      for r in trace.requests]
        engine = _engine(model, tokenizer, config)
        try:
            rows.append({"kind": kind, "k": k, "system": "paged", **_run(engine, prompts, params)})
            print(f"  {kind} {k}: {rows[-1]['saving']:.1%} of blocks saved", flush=True)
        finally:
            release(engine)
    return rows


def run_prefix(model, tokenizer, trace: Trace, config: SharingConfig) -> List[dict]:
    """Requests sharing a few-shot translation prefix: paged with and without the prefix cache, and the
    oracle reservation baseline (the paper's Figure 16 compares against Orca (Oracle))."""
    rows = []
    for shots in config.prefix_shots:
        prefix = few_shot_prefix(shots)
        prompts = [list(tokenizer(prefix + f"English: {sentence}\nGerman:", add_special_tokens=False)["input_ids"])
                   for sentence in _sentences(tokenizer, trace, config.prefix_requests)]
        prefix_len = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=config.prefix_output_len)] * len(prompts)
        for system, caching in (("paged", False), ("paged", True), ("oracle", False)):
            if system == "oracle":
                engine = build_engine(model, tokenizer, "oracle", config.kv_slots, max_model_len=MAX_TOTAL_TOKENS)
            else:
                engine = _engine(model, tokenizer, config, prefix_caching=caching)
            try:
                row = _run(engine, prompts, params, warm_first=True)
            finally:
                release(engine)
            rows.append({"kind": "prefix", "k": shots, "system": system, "prefix_tokens": prefix_len,
                         "prefix_caching": caching, **row})
            print(f"  prefix {shots}-shot, {system}, cache {caching}: {row['wall_s']:.1f} s", flush=True)
    return rows


def _sentences(tokenizer, trace: Trace, count: int) -> List[str]:
    texts = [tokenizer.decode(list(r.prompt_token_ids), skip_special_tokens=True).replace("\n", " ").strip()
             for r in trace.requests]
    texts = [t for t in texts if t] or ["The cache is split into blocks."]
    return [texts[i % len(texts)] for i in range(count)]


def run_sharing(config: SharingConfig) -> dict:
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model)
    trace = make_trace(config.workload, tokenizer, max(config.num_requests, config.prefix_requests), config.seed)
    branching_trace = Trace(trace.name, trace.requests[:config.num_requests], trace.synthetic, trace.description)
    rows = run_branching(model, tokenizer, branching_trace, config) + run_prefix(model, tokenizer, trace, config)
    for row in rows:
        if row["kind"] == "prefix" and row["prefix_caching"]:
            same = [r for r in rows if r["kind"] == "prefix" and r["k"] == row["k"] and not r["prefix_caching"]]
            plain = next(r for r in same if r["system"] == "paged")
            oracle = next(r for r in same if r["system"] == "oracle")
            row["speedup_vs_no_cache"] = plain["wall_s"] / row["wall_s"] if row["wall_s"] else None
            row["speedup_vs_oracle"] = oracle["wall_s"] / row["wall_s"] if row["wall_s"] else None
            row["peak_blocks_saved"] = 1 - row["peak_used_blocks"] / plain["peak_used_blocks"]
    return {"benchmark": "sharing", "config": asdict(config), "trace": branching_trace.summary(),
            "conditions": {"threads": threads}, "runs": rows, "paper_savings": PAPER_SAVINGS}


def sharing_table(result: dict) -> str:
    headers = ["case", "blocks saved (avg)", "saved at peak", "peak KV slots", "CoW copies", "cache hit",
               "cached prefill", "wall s", "speedup", "preempt"]
    rows = []
    for r in result["runs"]:
        if r["kind"] == "prefix":
            setup = "reserve oracle" if r["system"] == "oracle" else f"cache {'on' if r['prefix_caching'] else 'off'}"
            name = f"prefix {r['k']}-shot ({r['prefix_tokens']} tok), {setup}"
        else:
            name = f"{'parallel n' if r['kind'] == 'parallel' else 'beam width'}={r['k']}"
        cached = r["cached_prefill_tokens"] / r["prompt_tokens_total"] if r["prompt_tokens_total"] else 0.0
        rows.append([name, percent(r["saving"]), percent(r["peak_saving"]), r["peak_used_slots"], r["copy_on_write"],
                     percent(r["prefix_cache_hit_rate"]), percent(cached), f"{r['wall_s']:.1f}", _speedups(r),
                     r["preemptions"]])
    trace = result["trace"]
    title = (f"KV sharing: {trace['num_requests']} {trace['name']} requests "
             f"({'synthetic' if trace['synthetic'] else 'recorded'} lengths), {result['config']['model']}")
    return format_table(headers, rows, title)


def _speedups(row: dict) -> str:
    if "speedup_vs_oracle" not in row:
        return "-"
    return f"{row['speedup_vs_no_cache']:.2f}x no-cache, {row['speedup_vs_oracle']:.2f}x oracle"


def check_sharing(result: dict) -> List[str]:
    problems = []
    for r in result["runs"]:
        name = f"{r['kind']} {r['k']}" + (f" cache={r['prefix_caching']}" if r["kind"] == "prefix" else "")
        if r["num_finished"] != r["num_requests"]:
            problems.append(f"{name}: {r['num_finished']}/{r['num_requests']} finished")
        if r["leaked_blocks"]:
            problems.append(f"{name}: {r['leaked_blocks']} KV blocks leaked")
        sharing = r["kind"] != "prefix" or r["prefix_caching"]
        if sharing and not r["saving"] > 0:
            problems.append(f"{name}: no blocks saved by sharing")
        if r["kind"] == "prefix" and not r["prefix_caching"] and r["system"] == "paged" \
                and r["physical_block_steps"] != r["logical_block_steps"]:
            problems.append(f"{name}: blocks shared without the prefix cache")
        if r["kind"] == "prefix" and r["prefix_caching"] and not r["cached_prefill_tokens"]:
            problems.append(f"{name}: the prefix cache skipped no prefill")
    return problems


# The documented record runs on 2 torch threads (both cores of the reference machine), not a guess from the load.
SIZES = {"quick": QUICK, "full": {"threads": 2}}
SPEC = BenchmarkSpec("sharing", SharingConfig, run_sharing, check_sharing, sharing_table, "plot_sharing",
                     SIZES, documented_size="full")
