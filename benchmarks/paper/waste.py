"""Benchmark 1, memory waste (the paper's Figure 2): where the KV cache goes for paged vs reservation systems.

The whole trace is queued at once on engines with the same KV budget; every step the memory ledger
splits the cache into token states, reserved slots, internal and external fragmentation. By default
the model forward is replaced by a dry runner (memory behaviour does not depend on the logits, and
this lets a 500-request trace run in minutes); `--forward` runs the real model instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from paged_backend.benchmarks.paper.engine_runs import DryRunner, build_engine, load_bench_model, release, run_trace, set_threads
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table, percent
from paged_backend.benchmarks.harness.workloads import make_trace

# Read off the paper's Figure 2 (OPT-13B on an A100-40GB, ShareGPT, shares of KV memory in %).
PAPER_FIGURE_2 = {
    "max": {"token_states": 20.4, "reserved": 13.3, "internal": 57.3, "external": 8.9},
    "pow2": {"token_states": 26.8, "reserved": 17.9, "internal": 13.6, "external": 41.6},
    "oracle": {"token_states": 38.2, "reserved": 25.2, "internal": 0.0, "external": 36.6},
    "paged": {"token_states": 96.3, "reserved": 0.0, "internal": 3.7, "external": 0.0},
}


@dataclass
class WasteConfig:
    model: str = "tiny-llama"
    workload: str = "sharegpt"
    num_requests: int = 1000
    max_prompt_len: Optional[int] = None
    max_output_len: Optional[int] = None
    kv_slots: int = 16384
    block_size: int = 16
    systems: Tuple[str, ...] = ("paged", "oracle", "pow2", "max")
    allocators: Tuple[str, ...] = ("first-fit", "buddy")
    forward: bool = False
    seed: int = 0
    threads: Optional[int] = None
    max_seconds_per_system: Optional[float] = None
    extra: Dict[str, str] = field(default_factory=dict)


# Outputs capped so a smoke test takes seconds (the Max baseline still reserves the whole 2048-token context);
# blocks of 4 because these short sequences would leave a 16-slot block's unfilled tail a visible share.
QUICK = {"num_requests": 12, "max_output_len": 128, "kv_slots": 8192, "block_size": 4, "allocators": ("first-fit",)}
# The paper's Figure 13a (OPT-13B, ShareGPT): vLLM batches 2.2x the requests of Orca (Oracle), 4.3x Orca (Max).
PAPER_BATCH_NOTE = "paper Fig. 13a: vLLM batches 2.2x the requests of Orca (Oracle) and 4.3x those of Orca (Max)"


def _runs(config: WasteConfig) -> List[Tuple[str, str]]:
    """(system, allocator) pairs: the paged engine once, each baseline once per allocator."""
    pairs = []
    for system in config.systems:
        if system == "paged":
            pairs.append(("paged", "paged"))
        else:
            pairs += [(system, allocator) for allocator in config.allocators]
    return pairs


def run_waste(config: WasteConfig) -> dict:
    """Run every system over the same trace and budget; returns the JSON-ready result."""
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model)
    trace = make_trace(config.workload, tokenizer, config.num_requests, config.seed, config.max_prompt_len,
                       config.max_output_len)
    rows = []
    for system, allocator in _runs(config):
        engine = build_engine(model, tokenizer, system, config.kv_slots, config.block_size,
                              allocator=allocator if system != "paged" else "first-fit")
        if not config.forward:
            engine.runner = DryRunner.for_engine(engine)
        run = run_trace(engine, trace, system, config.kv_slots, config.max_seconds_per_system)
        row = run.as_dict()
        row["allocator"] = allocator
        rows.append(row)
        print(f"  {row['label']} [{allocator}]: token states {row['memory']['shares']['token_states']:.1%}, "
              f"avg batch {row['memory']['avg_batch_requests']:.1f}, {row['wall_s']:.0f} s", flush=True)
        release(engine)
    return {"benchmark": "waste", "config": asdict(config), "trace": trace.summary(),
            "forward": "model" if config.forward else "dry runner (no model forward)",
            "conditions": {"threads": threads}, "runs": rows, "paper_figure_2_percent": PAPER_FIGURE_2,
            "paper_batch_note": PAPER_BATCH_NOTE}


def waste_table(result: dict) -> str:
    headers = ["system", "allocator", "token states", "reserved", "internal frag", "external frag",
               "avg batch", "steps", "preempt", "leaked", "paper token states"]
    rows = []
    for run in result["runs"]:
        shares = run["memory"]["shares"]
        paper = PAPER_FIGURE_2.get(run["system"], {}).get("token_states")
        rows.append([run["label"], run["allocator"], percent(shares["token_states"]), percent(shares["reserved"]),
                     percent(shares["internal"]), percent(shares["external"]),
                     f'{run["memory"]["avg_batch_requests"]:.1f}', run["steps"], run["preemptions"],
                     run["leaked_blocks"], f"{paper}%" if paper is not None else "-"])
    trace = result["trace"]
    title = (f"KV memory waste: {trace['num_requests']} {trace['name']} requests, "
             f"{result['config']['kv_slots']} KV slots, {result['forward']}")
    return format_table(headers, rows, title)


def check_waste(result: dict) -> List[str]:
    """Invariants a correct run satisfies; returns the violations (empty when all hold)."""
    problems = []
    paged = [r for r in result["runs"] if r["system"] == "paged"]
    for run in result["runs"]:
        name = f"{run['system']}/{run['allocator']}"
        if run["leaked_blocks"]:
            problems.append(f"{name}: {run['leaked_blocks']} KV blocks leaked")
        if run["num_finished"] != run["num_requests"] or run["wrong_lengths"]:
            problems.append(f"{name}: {run['num_finished']}/{run['num_requests']} finished, "
                            f"{run['wrong_lengths']} with the wrong output length")
        if abs(sum(run["memory"]["shares"].values()) - 1.0) > 1e-9:
            problems.append(f"{name}: shares do not add up to 1")
    if paged:
        share = paged[0]["memory"]["shares"]["token_states"]
        if result["trace"]["name"] == "sharegpt" and share < 0.95:
            problems.append(f"paged token-state share {share:.3f} < 0.95 on ShareGPT")
        if paged[0]["memory"]["shares"]["external"] != 0:
            problems.append("paged engine shows external fragmentation")
        for run in result["runs"]:
            if run["system"] != "paged" and run["memory"]["shares"]["token_states"] >= share:
                problems.append(f"{run['system']}/{run['allocator']} keeps as many token states as paging")
    return problems


# The documented record fixes 1 thread (the dry runner runs no model) rather than a guess from the load.
SIZES = {"quick": QUICK, "full": {"threads": 1}}
SPEC = BenchmarkSpec("waste", WasteConfig, run_waste, check_waste, waste_table, "plot_waste",
                     SIZES, documented_size="full")
