"""How much the anchor workload recomputes after preemption under other scheduling policies.

`python -m paged_backend.benchmarks.recompute_policies` runs the throughput benchmark's anchor trace (64
ShareGPT requests, prompts <= 256, outputs <= 128, 192 blocks of 16) through the engine with the dry runner
(no forward: scheduling, block management and sampling only, so the counts are the engine's own and
deterministic) under: the default; higher admission watermarks; a reserve of free blocks per running
sequence before a new request is admitted (not an engine option: a what-if scheduler defined here); and
preemption by swapping (which needs host blocks beyond the KV budget). It prints steps, preemptions,
recomputed tokens (share of the trace's prompt + output tokens), prefill tokens run, the average batch and
the average share of the whole cache holding tokens (what a reserve gives up).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Dict, List, Optional, Sequence

from paged_backend.core.block_manager import AllocStatus
from paged_backend.core.scheduler import Scheduler

from .engine_runs import DryRunner, build_engine, load_bench_model, release, run_trace
from .report import format_table
from .throughput import ANCHOR
from .workloads import make_trace


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


POLICIES: Dict[str, dict] = {
    "default (watermark 0.01, recompute)": {},
    "watermark 0.05": {"watermark": 0.05},
    "watermark 0.10": {"watermark": 0.10},
    "reserve 1 block per running sequence": {"reserve_per_seq": 1.0},
    "reserve 2 blocks per running sequence": {"reserve_per_seq": 2.0},
    "swap (4096 host blocks beyond the budget)": {"preemption_mode": "swap", "num_swap_blocks": 4096},
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    model, tokenizer = load_bench_model(ANCHOR["model"])
    trace = make_trace(ANCHOR["workload"], tokenizer, ANCHOR["num_requests"], 0, ANCHOR["max_prompt_len"],
                       ANCHOR["max_output_len"])
    rows: List[List[str]] = []
    for name, options in POLICIES.items():
        r = run_policy(model, tokenizer, trace, options)
        rows.append([name, str(r["steps"]), str(r["preemptions"]), f"{r['recomputed']} ({r['recomputed_share']:.1%})",
                     str(r["prefill_tokens"]), f"{r['avg_batch']:.1f}", f"{r['cache_filled']:.1%}",
                     str(r["failed"] + r["wrong_lengths"])])
        print(rows[-1], flush=True)
    print(format_table(["policy", "steps", "preemptions", "recomputed (share)", "prefill tokens",
                        "avg batch", "cache holding tokens", "failed"], rows,
                       title=f"Anchor trace, dry runner: {len(trace.requests)} requests, 192 blocks of 16"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
