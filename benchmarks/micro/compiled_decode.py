"""Batch-1 decode per token, eager against compiled (`compile=...`, docs/compilation.md), per dtype, beside this
machine's floor (the weights' bytes over the measured memory bandwidth: a decode step reads every weight once);
and what compiling costs: the first start (an empty inductor cache) and a later start (the cache on disk), each
in a fresh process. The bandwidth is read again right before every repetition and each repetition's compiled step
is divided by that repetition's floor: this machine's read bandwidth moves between about 33 and 57 GB/s from one
minute to the next (other tenants), so a floor read once at the start says little about a step timed minutes later.
Run: `paged-backend bench compiled-decode --documented` (record: docs/measurements/compiled-decode.json).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

import torch

from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table
from paged_backend.worker.child_python import python_command
from paged_backend.benchmarks.paper.engine_runs import load_bench_model, set_threads

# A fresh process that builds a compiled engine and prints how long that took (argv: model, dtype, kv blocks).
_START = """
import json, sys, time
import torch
from paged_backend import LLMEngine, load_model
model, _ = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
began = time.perf_counter()
engine = LLMEngine(model, num_blocks=int(sys.argv[3]), compile="blocking")
print(json.dumps({"seconds": time.perf_counter() - began, "stats": engine.runner.compiled.stats.as_dict()}))
"""


@dataclass
class CompiledDecodeConfig:
    model: str = "smollm2"
    dtypes: Tuple[str, ...] = ("float32", "bfloat16")
    threads: int = 2
    prompt_tokens: int = 32
    decode_steps: int = 32
    repetitions: int = 5
    bandwidth_mib: int = 512       # the buffer the bandwidth is measured on (larger than the caches)
    bandwidth_reads: int = 3       # reads of it before each repetition, the best taken
    first_start: bool = True       # also time a start with an empty inductor cache (minutes on 2 cores)
    fill_cache_first: bool = True  # one untimed start first, so that the timed later start reads a filled cache


def memory_bandwidth(mib: int, repeats: int = 7) -> Dict[str, float]:
    """Read bandwidth in GB/s: the best and the median of `repeats` sums over a `mib` MiB buffer."""
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    rates = []
    for _ in range(repeats):
        began = time.perf_counter()
        buffer.sum()
        rates.append(buffer.numel() * 4 / (time.perf_counter() - began) / 1e9)
    return {"best_gb_s": max(rates), "median_gb_s": statistics.median(rates)}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied embeddings once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_ms(engine, prompt: List[int], steps: int) -> Tuple[float, List[int]]:
    """One request's decode steps after its prefill: the median step in ms, and its greedy tokens."""
    from paged_backend import SamplingParams

    engine.add_request("one", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 1))
    engine.step()              # the prefill and the first token
    times, final = [], None
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        for output in engine.step():
            final = output
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times), list(final.outputs[0].token_ids)


def timed_start(model: str, dtype: str, cache_dir: str, num_blocks: int) -> dict:
    """A compiled engine built in a fresh process with `cache_dir` as inductor's cache."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([*python_command(), "-c", _START, model, dtype, str(num_blocks)], capture_output=True,
                          text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the compiled start failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values: List[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run_dtype(config: CompiledDecodeConfig, dtype: str) -> dict:
    from paged_backend import LLMEngine
    from paged_backend.worker.compiled_forward import inductor_cache_dir

    num_blocks = (config.prompt_tokens + config.decode_steps) // 16 + 4
    starts = {}
    if config.first_start:
        with tempfile.TemporaryDirectory(prefix="inductor-") as empty:
            starts["first"] = timed_start(config.model, dtype, empty, num_blocks)
    if config.fill_cache_first:
        timed_start(config.model, dtype, inductor_cache_dir(), num_blocks)   # fills the cache if it is empty
    starts["later"] = timed_start(config.model, dtype, inductor_cache_dir(), num_blocks)
    from paged_backend.worker.compute_thread import run_on_compute_thread

    model, _ = run_on_compute_thread(load_bench_model, config.model, dtype=getattr(torch, dtype))
    engines = {"eager": LLMEngine(model, num_blocks=num_blocks),
               "compiled": LLMEngine(model, num_blocks=num_blocks, compile="blocking")}
    prompt = [100 + i for i in range(config.prompt_tokens)]
    for engine in engines.values():   # warm-up
        decode_ms(engine, prompt, 2)
    times: Dict[str, List[float]] = {name: [] for name in engines}
    tokens: Dict[str, List[int]] = {}
    weights = weight_bytes(model)
    rates, floors = [], []
    for _ in range(config.repetitions):   # interleaved, each after a read of the bandwidth
        rates.append(run_on_compute_thread(memory_bandwidth, config.bandwidth_mib, config.bandwidth_reads)["best_gb_s"])
        floors.append(weights / (rates[-1] * 1e9) * 1000)
        for name, engine in engines.items():
            ms, tokens[name] = decode_ms(engine, prompt, config.decode_steps)
            times[name].append(ms)
    floors_ms = _spread(floors)
    return {"dtype": dtype, "weight_bytes": weights, "floor_ms": floors_ms["median"], "floors_ms": floors_ms,
            "bandwidth_gb_s": _spread(rates),
            "to_floor": _spread([ms / floor for ms, floor in zip(times["compiled"], floors)]),
            "decode_ms": {name: _spread(values) for name, values in times.items()},
            "same_greedy_tokens": tokens["eager"] == tokens["compiled"],
            "compiled_stats": engines["compiled"].runner.compiled.stats.as_dict(),
            "starts_s": {name: start["seconds"] for name, start in starts.items()}}


def run_compiled_decode(config: CompiledDecodeConfig) -> dict:
    from paged_backend.worker.compute_thread import run_on_compute_thread

    threads = set_threads(config.threads)
    # torch work on the compute thread, as the engines' own (compute_thread.py: one OpenMP team per process)
    rows = []
    for dtype in config.dtypes:
        rows.append(run_dtype(config, dtype))
        print(f"  {dtype}: eager {rows[-1]['decode_ms']['eager']['median']:.1f} ms, compiled "
              f"{rows[-1]['decode_ms']['compiled']['median']:.1f} ms per token, "
              f"{rows[-1]['to_floor']['median']:.2f}x its floor", flush=True)
    rates = [rate for row in rows for rate in row["bandwidth_gb_s"]["values"]]
    bandwidth = {"best_gb_s": max(rates), "median_gb_s": statistics.median(rates), "min_gb_s": min(rates)}
    return {"benchmark": "compiled-decode", "config": asdict(config), "bandwidth": bandwidth, "rows": rows,
            "conditions": {"threads": threads}}


def check_compiled_decode(result: dict) -> List[str]:
    problems = []
    for row in result["rows"]:
        stats = row["compiled_stats"]
        failed = [name for name, bucket in stats["buckets"].items() if not bucket["ready"]]
        if failed:
            problems.append(f"{row['dtype']}: buckets {failed} did not compile")
        if stats["eager_steps"]:
            problems.append(f"{row['dtype']}: {stats['eager_steps']} steps of the compiled engine ran eagerly")
    return problems


def compiled_decode_table(result: dict) -> str:
    c, bandwidth = result["config"], result["bandwidth"]

    def spread(d: dict, digits: int = 1, unit: str = "") -> str:
        return f"{d['median']:.{digits}f}{unit} ({d['min']:.{digits}f}-{d['max']:.{digits}f})"

    rows = []
    for row in result["rows"]:
        eager, compiled = row["decode_ms"]["eager"], row["decode_ms"]["compiled"]
        starts = row["starts_s"]
        rows.append([row["dtype"], f"{row['weight_bytes'] / 2**20:.0f}", spread(row["floors_ms"]), spread(eager),
                     spread(compiled), f"{eager['median'] / compiled['median']:.2f}x",
                     spread(row["to_floor"], 2, "x"),
                     f"{starts['first']:.0f}" if "first" in starts else "-", f"{starts['later']:.0f}",
                     "yes" if row["same_greedy_tokens"] else "no"])
    return format_table(["dtype", "weights MiB", "floor ms", "eager ms/token", "compiled ms/token", "speed-up",
                         "compiled / floor", "first start s", "later start s", "same tokens"], rows,
                        title=f"{c['model']}, one request: {c['prompt_tokens']}-token prompt, {c['decode_steps']} "
                              f"decode steps, median step per repetition, median (min-max) of {c['repetitions']} "
                              f"interleaved repetitions; {result['conditions']['threads']} threads; floor = weights "
                              f"/ the best of {c['bandwidth_reads']} reads of a {c['bandwidth_mib']} MiB buffer "
                              f"right before each repetition ({bandwidth['min_gb_s']:.1f}-{bandwidth['best_gb_s']:.1f} "
                              f"GB/s over the run); compiled / floor per repetition")


SPEC = BenchmarkSpec("compiled-decode", CompiledDecodeConfig, run_compiled_decode, check_compiled_decode,
                     compiled_decode_table, "",
                     {"quick": {"model": "tiny-llama", "dtypes": ("float32",), "threads": 1, "prompt_tokens": 8,
                                "decode_steps": 4, "repetitions": 2, "bandwidth_mib": 16, "first_start": False,
                                "fill_cache_first": False},
                      "full": {}},
                     documented_size="full")
