"""Benchmark 2, throughput at equal KV memory: the same trace, model, dtype and KV budget through
our paged engine, the reservation baselines (same engine, contiguous reservations), HF static
`generate` and transformers' continuous batching; ratios to ours side by side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from .engine_runs import SYSTEM_LABELS, build_engine, load_bench_model, release, run_trace, set_threads, warm_up
from .hf_baselines import run_hf_continuous, run_hf_static
from .report import conditions, format_table, load_average, percent
from .workloads import make_trace

ENGINE_SYSTEMS = ("paged", "oracle", "pow2", "max")
HF_SYSTEMS = ("hf-static", "hf-continuous")
LABELS = {**SYSTEM_LABELS, "hf-static": "HF generate, static batches", "hf-continuous": "HF continuous batching"}
# vLLM's paper (Figure 12, ShareGPT, OPT-13B): sustained request rate vs Orca baselines at similar latency.
PAPER_NOTE = ("paper Fig. 12a (ShareGPT, OPT-13B): vLLM sustains 1.7x-2.7x the request rate of Orca (Oracle) "
              "and 2.7x-8x that of Orca (Max); up to 22x FasterTransformer")


@dataclass
class ThroughputConfig:
    model: str = "smollm2"
    workload: str = "sharegpt"
    num_requests: int = 16
    kv_slots: int = 4096
    block_size: int = 16
    systems: Tuple[str, ...] = ENGINE_SYSTEMS + HF_SYSTEMS
    allocator: str = "first-fit"
    seed: int = 0
    threads: Optional[int] = None
    dtype: str = "float32"


QUICK = {"model": "tiny-llama", "num_requests": 6, "kv_slots": 4096}


def _run_system(system: str, model, tokenizer, trace, config: ThroughputConfig) -> dict:
    if system in HF_SYSTEMS:
        runner = run_hf_static if system == "hf-static" else run_hf_continuous
        return runner(model, tokenizer, trace, config.kv_slots).as_dict()
    engine = build_engine(model, tokenizer, system, config.kv_slots, config.block_size, allocator=config.allocator)
    try:
        warm_up(engine, list(trace.requests[0].prompt_token_ids))
        return run_trace(engine, trace, system, config.kv_slots).as_dict()
    finally:
        release(engine)


def run_throughput(config: ThroughputConfig) -> dict:
    import torch

    unknown = set(config.systems) - set(ENGINE_SYSTEMS + HF_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; use {ENGINE_SYSTEMS + HF_SYSTEMS}")
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model, getattr(torch, config.dtype))
    trace = make_trace(config.workload, tokenizer, config.num_requests, config.seed)
    # HF continuous batching may switch the model's attention implementation: run it last.
    order = sorted(config.systems, key=lambda s: s == "hf-continuous")
    runs = []
    for system in order:
        load_before = load_average()
        row = _run_system(system, model, tokenizer, trace, config)
        row.update(label=LABELS[system], load_before=load_before, load_after=load_average())
        runs.append(row)
        print(f"  {LABELS[system]}: {row['output_tokens_per_s']:.1f} output tok/s, {row['wall_s']:.0f} s", flush=True)
    ours = next((r for r in runs if r["system"] == "paged"), None)
    for row in runs:
        row["paged_speedup"] = (ours["output_tokens_per_s"] / row["output_tokens_per_s"]
                                if ours and row["output_tokens_per_s"] else None)
    return {"benchmark": "throughput", "config": asdict(config), "trace": trace.summary(),
            "conditions": conditions(threads=threads), "runs": runs, "paper": PAPER_NOTE}


def throughput_table(result: dict) -> str:
    headers = ["system", "req/s", "out tok/s", "paged is x", "avg batch", "token states", "wall s", "preempt"]
    rows = []
    for run in result["runs"]:
        memory = run.get("memory")
        batch = memory["avg_batch_requests"] if memory else run.get("avg_batch")
        speedup = run["paged_speedup"]
        rows.append([run["label"], f"{run['requests_per_s']:.3f}", f"{run['output_tokens_per_s']:.1f}",
                     f"{speedup:.2f}" if speedup else "-", f"{batch:.1f}" if batch else "-",
                     percent(memory["shares"]["token_states"]) if memory else "-", f"{run['wall_s']:.1f}",
                     run.get("preemptions", "-")])
    trace, config = result["trace"], result["config"]
    title = (f"Throughput at equal KV memory ({config['kv_slots']} token slots): {trace['num_requests']} "
             f"{trace['name']} requests, {trace['total_output_tokens']} output tokens, {config['model']} "
             f"{config['dtype']}, {result['conditions']['torch_threads']} threads")
    return format_table(headers, rows, title)


def check_throughput(result: dict) -> List[str]:
    problems = []
    for run in result["runs"]:
        if run["num_finished"] != run["num_requests"] or run["wrong_lengths"]:
            problems.append(f"{run['system']}: {run['num_finished']}/{run['num_requests']} finished, "
                            f"{run['wrong_lengths']} with the wrong output length")
        if run["output_tokens"] != result["trace"]["total_output_tokens"]:
            problems.append(f"{run['system']}: {run['output_tokens']} useful output tokens, "
                            f"expected {result['trace']['total_output_tokens']}")
        if run.get("leaked_blocks"):
            problems.append(f"{run['system']}: {run['leaked_blocks']} KV blocks leaked")
    return problems


def main(config: ThroughputConfig, out_dir, plot: bool = True) -> dict:
    """Run, print the table, write throughput.json and throughput.png under `out_dir`."""
    from .plots import plot_throughput
    from .report import run_and_report

    return run_and_report("throughput", lambda: run_throughput(config), check_throughput, throughput_table,
                          plot_throughput if plot else None, out_dir)
