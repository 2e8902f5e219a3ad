"""How much the anchor workload recomputes after preemption under other scheduling policies.

`paged-backend bench recompute-policies --documented` runs the throughput benchmark's anchor trace (64
ShareGPT requests, prompts <= 256, outputs <= 128, 192 blocks of 16) through the engine with the dry runner
(no forward: scheduling, block management and sampling only, so the counts are the engine's own and
deterministic) under: vLLM's on-demand admission; higher admission watermarks; a reserve of free blocks per
running sequence before a new request is admitted (not an engine option: a what-if scheduler defined here); the
engine's backoff after a preemption (`admission_backoff_steps`, the default 512 and 128); and preemption by
swapping (which needs host blocks beyond the KV budget). It records steps, preemptions,
recomputed tokens (share of the trace's prompt + output tokens), prefill tokens run, the average batch and
the average share of the whole cache holding tokens (what a reserve gives up), in
docs/measurements/recompute-policies.json.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from paged_backend.core.block_manager import AllocStatus
from paged_backend.core.scheduler import Scheduler

from paged_backend.benchmarks.paper.engine_runs import DryRunner, build_engine, load_bench_model, release, run_trace, set_threads
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table
from paged_backend.benchmarks.paper.throughput import ANCHOR, QUICK
from paged_backend.benchmarks.harness.workloads import make_trace


class ReservingScheduler(Scheduler):
    """Admits a request that never ran only if `reserve_per_seq` free blocks per running sequence remain
    after it (room for the running ones to grow); preempted requests come back as before."""

    reserve_per_seq = 1.0

    def _admit_waiting(self, out, budget) -> None:
        bm = self.block_manager
        plain = bm.can_allocate

        def can_allocate(group):  # the running set grows as this pass admits requests
            status = plain(group)
            reserve = math.ceil(self.reserve_per_seq * sum(g.max_num_running_seqs() for g in self.running))
            room = bm.get_num_free_blocks() - bm.admission_blocks(group) - bm.watermark_blocks
            if status == AllocStatus.OK and group.num_preemptions == 0 and room < reserve:
                return AllocStatus.LATER
            return status
        bm.can_allocate = can_allocate
        try:
            super()._admit_waiting(out, budget)
        finally:
            del bm.can_allocate


ON_DEMAND = {"admission_backoff_steps": 0}
POLICIES: Dict[str, dict] = {
    "on demand (vLLM's: watermark 0.01, recompute)": ON_DEMAND,
    "watermark 0.05": {**ON_DEMAND, "watermark": 0.05},
    "watermark 0.10": {**ON_DEMAND, "watermark": 0.10},
    "reserve 1 block per running sequence": {**ON_DEMAND, "reserve_per_seq": 1.0},
    "reserve 2 blocks per running sequence": {**ON_DEMAND, "reserve_per_seq": 2.0},
    "backoff 128 steps after a preemption": {"admission_backoff_steps": 128},
    "default (backoff 512 steps after a preemption)": {},
    "swap (4096 host blocks beyond the budget)": {**ON_DEMAND, "preemption_mode": "swap", "num_swap_blocks": 4096},
}


def run_policy(model, tokenizer, trace, options: dict, size: dict = ANCHOR) -> dict:
    """One dry run of `trace` under a policy (`POLICIES`' options) at a throughput size's KV budget."""
    options = dict(options)
    reserve = options.pop("reserve_per_seq", None)
    engine = build_engine(model, tokenizer, "paged", size["kv_slots"], size.get("block_size", 16),
                          size["max_prompt_len"] + size["max_output_len"], **options)
    if reserve is not None:  # the engine's scheduler, with this admission rule on top
        engine.scheduler.__class__ = ReservingScheduler
        engine.scheduler.reserve_per_seq = reserve
    engine.runner = DryRunner.for_engine(engine)
    try:
        run = run_trace(engine, trace, "paged", size["kv_slots"])
    finally:
        release(engine)
    trace_tokens = sum(r.prompt_len + r.output_len for r in trace.requests)
    return {"steps": run.steps, "preemptions": run.preemptions, "recomputed": run.recomputed_tokens,
            "recomputed_share": run.recomputed_tokens / trace_tokens, "prefill_tokens": run.prompt_tokens,
            "cache_filled": run.tally.token_states / max(run.tally.idle + run.tally.wasted_or_used, 1),
            "avg_batch": run.tally.avg_batch_requests, "failed": run.num_failed, "wrong_lengths": run.wrong_lengths}


@dataclass
class RecomputeConfig:
    """The trace and the KV budget (the throughput benchmark's anchor by default)."""

    model: str = "smollm2"
    workload: str = "sharegpt"
    num_requests: int = 64
    max_prompt_len: int = 256
    max_output_len: int = 128
    kv_slots: int = 3072
    block_size: int = 16
    seed: int = 0
    threads: Optional[int] = None


def run_recompute_policies(config: RecomputeConfig) -> dict:
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model)
    trace = make_trace(config.workload, tokenizer, config.num_requests, config.seed, config.max_prompt_len,
                       config.max_output_len)
    size = asdict(config)
    rows = []
    for name, options in POLICIES.items():
        rows.append({"policy": name, **run_policy(model, tokenizer, trace, options, size)})
        print(f"  {name}: {rows[-1]['preemptions']} preemptions, {rows[-1]['recomputed']} recomputed", flush=True)
    return {"benchmark": "recompute-policies", "config": size, "conditions": {"threads": threads},
            "trace_prompt_tokens": sum(r.prompt_len for r in trace.requests), "rows": rows}


def check_recompute_policies(result: dict) -> List[str]:
    """Every request finishes at its length; swapping recomputes nothing; the prefill tokens add up."""
    problems = []
    prompts = result["trace_prompt_tokens"]
    for row in result["rows"]:
        if row["failed"] or row["wrong_lengths"]:
            problems.append(f"{row['policy']}: {row['failed']} failed, {row['wrong_lengths']} at a wrong length")
        swapped = row["policy"].startswith("swap")
        expected = prompts if swapped else prompts + row["recomputed"] + row["preemptions"]
        if row["prefill_tokens"] != expected or (swapped and row["recomputed"]):
            problems.append(f"{row['policy']}: {row['prefill_tokens']} prefill tokens, expected {expected}")
    return problems


def recompute_policies_table(result: dict) -> str:
    c = result["config"]
    rows = [[r["policy"], str(r["steps"]), str(r["preemptions"]), f"{r['recomputed']} ({r['recomputed_share']:.1%})",
             str(r["prefill_tokens"]), f"{r['avg_batch']:.1f}", f"{r['cache_filled']:.1%}",
             str(r["failed"] + r["wrong_lengths"])] for r in result["rows"]]
    return format_table(["policy", "steps", "preemptions", "recomputed (share)", "prefill tokens", "avg batch",
                         "cache holding tokens", "failed"], rows,
                        title=f"{c['workload']} trace, dry runner: {c['num_requests']} requests, "
                              f"{c['kv_slots'] // c['block_size']} blocks of {c['block_size']}")


ANCHOR_SIZE = {k: ANCHOR[k] for k in ("model", "workload", "num_requests", "max_prompt_len", "max_output_len",
                                      "kv_slots", "block_size")}
QUICK_SIZE = {**{k: QUICK[k] for k in ("model", "max_prompt_len", "max_output_len")}, "num_requests": 12,
              "kv_slots": 96}
SPEC = BenchmarkSpec("recompute-policies", RecomputeConfig, run_recompute_policies, check_recompute_policies,
                     recompute_policies_table, "", {"quick": QUICK_SIZE, "anchor": ANCHOR_SIZE},
                     documented_size="anchor")
