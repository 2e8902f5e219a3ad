"""Study: the cost of serving LoRA adapters. The throughput benchmark's anchor workload (64 ShareGPT requests,
prompts cut to 256 tokens, outputs capped at 128, 3072 KV slots, smollm2 float32) runs on the base model alone
and spread round-robin over 4 adapters, in interleaved rounds:

- `base`: an engine without LoRA;
- `lora-4`: `enable_lora`, 4 device slots: every step mixes the base model's and up to 4 adapters' tokens in
  one forward (the grouped LoRA matmuls around each targeted layer);
- `lora-4-one-slot`: the same requests with `max_loras=1`: the adapters take turns in one slot (LRU swap-ins;
  the scheduler runs one adapter at a time), so it shows what too few slots cost (in the quick size only: the
  documented run keeps to the two systems the issue compares, which halves its time).

The adapters are written in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, random A and B,
rank `rank` on `target_modules`) into the scratch folder, and read from there like any adapter. The swap-in
cost is measured apart: reading and checking one adapter from disk, and moving it into a device slot (medians
of `swap_samples` runs). The LoRA systems must give the same tokens (the same adapter for each request).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from paged_backend import LLMEngine, LoRARequest
from paged_backend.benchmarks.harness.provenance import load_average
from paged_backend.benchmarks.harness.repeat import format_spread, paired_ratio, run_interleaved, spread
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table
from paged_backend.benchmarks.harness.workloads import Trace, make_trace
from paged_backend.benchmarks.paper.engine_runs import (forced_params, leaked_blocks, load_bench_model, release,
                                                         set_threads, token_digest, warm_up)

SYSTEMS = ("base", "lora-4", "lora-4-one-slot")
TARGET = 0.8   # lora-4 / base output tokens/s the issue asks for


@dataclass
class LoRABenchConfig:
    model: str = "smollm2"
    workload: str = "sharegpt"
    num_requests: int = 64
    max_prompt_len: Optional[int] = 256
    max_output_len: Optional[int] = 128
    kv_slots: int = 3072
    block_size: int = 16
    num_adapters: int = 4
    rank: int = 16
    target_modules: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    repetitions: int = 3
    swap_samples: int = 5
    seed: int = 0
    threads: Optional[int] = 2
    systems: Tuple[str, ...] = SYSTEMS

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        self.systems = tuple(self.systems)
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or "base" not in self.systems:
            raise ValueError(f"systems must include 'base' and be among {SYSTEMS}, got {self.systems}")


def write_adapter(model: torch.nn.Module, directory: Path, rank: int, targets: Tuple[str, ...], seed: int) -> Path:
    """A PEFT LoRA directory for `model` with random A and B (scaled so the adapter changes the outputs)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
            b = torch.randn(module.out_features, rank, generator=generator) / rank ** 0.5 * 0.1
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError(f"no linear layer of {type(model).__name__} is named one of {targets}")
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0, "use_rslora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


def _engine(model, tokenizer, config: LoRABenchConfig, system: str, context: int) -> LLMEngine:
    options = dict(block_size=config.block_size, num_blocks=config.kv_slots // config.block_size, num_swap_blocks=0,
                   max_model_len=context)
    if system != "base":
        slots = 1 if system == "lora-4-one-slot" else config.num_adapters
        options.update(enable_lora=True, max_loras=slots, max_cpu_loras=config.num_adapters,
                       max_lora_rank=config.rank)
    return LLMEngine(model, tokenizer, **options)


def _run(engine: LLMEngine, trace: Trace, adapters: List[Optional[LoRARequest]], tag: str) -> dict:
    """The whole trace queued at once (request i with adapter i mod n), stepped to the end."""
    wanted = {}
    before = engine.get_stats()
    start = time.perf_counter()
    for i, request in enumerate(trace.requests):
        rid = f"{tag}-{i}"
        engine.add_request(rid, list(request.prompt_token_ids), forced_params(request),
                           lora_request=adapters[i % len(adapters)])
        wanted[rid] = request.output_len
    tokens: Dict[str, List[int]] = {}
    failed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                failed += out.error is not None
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    produced = sum(len(t) for t in tokens.values())
    stats = engine.get_stats()
    return {"wall_s": wall, "output_tokens": produced, "output_tokens_per_s": produced / wall, "failed": failed,
            "wrong_lengths": sum(len(tokens.get(r, [])) != n for r, n in wanted.items()),
            "steps": stats.num_steps - before.num_steps, "preemptions": stats.num_preemptions - before.num_preemptions,
            "slot_loads": stats.num_lora_loads - before.num_lora_loads,
            "digests": [token_digest(tokens.get(r, [])) for r in wanted]}


def _median_ms(samples: List[float]) -> float:
    return 1000 * statistics.median(samples)


def swap_in_cost(model, tokenizer, config: LoRABenchConfig, adapters: List[LoRARequest]) -> dict:
    """Reading and checking an adapter from disk, and moving it into a device slot (median ms of samples)."""
    from paged_backend.worker.lora_checkpoint import read_peft_adapter

    engine = _engine(model, tokenizer, config, "lora-4-one-slot", 64)
    try:
        layers = engine.runner.lora
        disk, slot = [], []
        for i in range(config.swap_samples):
            lora = adapters[i % len(adapters)]
            start = time.perf_counter()
            weights = read_peft_adapter(lora.lora_name, lora.lora_path)
            layers.check(weights)
            disk.append(time.perf_counter() - start)
            start = time.perf_counter()
            layers.load(0, weights)
            slot.append(time.perf_counter() - start)
        nbytes = weights.nbytes
    finally:
        release(engine)
    return {"adapter_mib": nbytes / 2 ** 20, "disk_read_ms": _median_ms(disk), "slot_load_ms": _median_ms(slot),
            "samples": config.swap_samples}


def run_lora(config: LoRABenchConfig, scratch_dir: Path) -> dict:
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model, torch.float32)
    trace = make_trace(config.workload, tokenizer, config.num_requests, config.seed, config.max_prompt_len,
                       config.max_output_len)
    context = max(r.total_len for r in trace.requests) + 1
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_adapter(model, Path(scratch_dir) / f"adapter{i}",
                                                                    config.rank, config.target_modules, 100 + i)))
                for i in range(config.num_adapters)]

    def one(system: str, rep: int) -> dict:
        before = load_average()
        engine = _engine(model, tokenizer, config, system, context)
        try:
            warm_up(engine, list(trace.requests[0].prompt_token_ids))
            row = _run(engine, trace, [None] if system == "base" else adapters, f"{system}-{rep}")
            row["leaked_blocks"] = leaked_blocks(engine)
        finally:
            release(engine)
        row.update(load_before=before, load_after=load_average())
        print(f"  round {rep + 1}/{config.repetitions} {system}: {row['output_tokens_per_s']:.1f} output tok/s, "
              f"{row['wall_s']:.0f} s, {row['slot_loads']} slot loads", flush=True)
        return row

    runs = run_interleaved(config.systems, config.repetitions, one)
    rows = []
    for system in config.systems:
        mine = [r for r in runs if r["system"] == system]
        rows.append({"system": system, "output_tokens_per_s": spread([r["output_tokens_per_s"] for r in mine]),
                     "wall_s": spread([r["wall_s"] for r in mine]), "steps": mine[0]["steps"],
                     "slot_loads": spread([r["slot_loads"] for r in mine]),
                     "ratio": paired_ratio(runs, system, "base", "output_tokens_per_s")})
    return {"benchmark": "lora", "config": asdict(config), "trace": trace.summary(), "target_ratio": TARGET,
            "conditions": {"threads": threads}, "runs": runs, "rows": rows,
            "swap_in": swap_in_cost(model, tokenizer, config, adapters)}


def lora_table(result: dict) -> str:
    headers = ["system", "output tok/s", "vs base", "wall s", "steps", "slot loads"]
    rows = [[r["system"], format_spread(r["output_tokens_per_s"]), format_spread(r["ratio"], 3, "x"),
             format_spread(r["wall_s"]), r["steps"], format_spread(r["slot_loads"], 0)] for r in result["rows"]]
    c, s = result["config"], result["swap_in"]
    title = (f"LoRA: {c['num_requests']} {c['workload']} requests on {c['model']}, base model alone vs spread over "
             f"{c['num_adapters']} adapters (rank {c['rank']} on {', '.join(c['target_modules'])}; target >= "
             f"{result['target_ratio']}x); {result['conditions']['torch_threads']} threads, median (range) of "
             f"{c['repetitions']} interleaved rounds")
    swap = (f"swap-in of one adapter ({s['adapter_mib']:.2f} MiB): read and checked from disk "
            f"{s['disk_read_ms']:.1f} ms, moved into a device slot {s['slot_load_ms']:.2f} ms (medians of "
            f"{s['samples']})")
    return format_table(headers, rows, title) + "\n" + swap


def check_lora(result: dict) -> List[str]:
    problems = []
    for run in result["runs"]:
        where = f"{run['system']} round {run['repetition']}"
        if run["failed"] or run["wrong_lengths"]:
            problems.append(f"{where}: {run['failed']} failed, {run['wrong_lengths']} of the wrong length")
        if run["leaked_blocks"]:
            problems.append(f"{where}: {run['leaked_blocks']} KV blocks leaked")
        if run["system"] != "base" and run["slot_loads"] < result["config"]["num_adapters"]:
            problems.append(f"{where}: {run['slot_loads']} slot loads for {result['config']['num_adapters']} adapters")
    digests = {tuple(r["digests"]) for r in result["runs"] if r["system"] != "base"}
    if len(digests) > 1:
        problems.append("the LoRA systems gave different tokens for the same requests and adapters")
    if digests and digests == {tuple(r["digests"]) for r in result["runs"] if r["system"] == "base"}:
        problems.append("the adapters did not change a single token: they were not applied")
    return problems


# Quick: a smoke test (tiny-llama, rank 4). Anchor: the throughput benchmark's anchor workload, 2 threads.
QUICK = {"model": "tiny-llama", "num_requests": 8, "max_prompt_len": 32, "max_output_len": 12, "kv_slots": 256,
         "rank": 4, "repetitions": 1, "swap_samples": 2, "threads": 1}
ANCHOR = {"threads": 2, "systems": ("base", "lora-4")}
SIZES = {"quick": QUICK, "anchor": ANCHOR}
SPEC = BenchmarkSpec("lora", LoRABenchConfig, run_lora, check_lora, lora_table, "", SIZES, documented_size="anchor",
                     uses_scratch_dir=True)
