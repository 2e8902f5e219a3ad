"""Which threads of a server keep the CPU busy at low concurrency: one streaming client sends requests one
after another to ours and to `transformers serve --continuous-batching` (the serving benchmark's systems, same
weights, KV budget and threads), under each OpenMP wait policy (`OMP_WAIT_POLICY` unset, PASSIVE, ACTIVE, set
for both servers), and each thread's CPU seconds are read from /proc/PID/task before and after. Then, in this
process with the same threads, one request's decode step: our engine's `step()` and transformers' plain
`model(...)` forward with a `DynamicCache`.

Answers the question the serving benchmark raised: at concurrency 1-4 transformers kept about 1.8 cores busy
where ours kept about one (docs/benchmarks.md, "Why transformers keeps more cores busy"). Run:
`paged-backend bench busy-threads --documented` (record: docs/measurements/busy-threads.json).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

import httpx

from paged_backend.benchmarks.paper.engine_runs import load_bench_model, set_threads
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table
from paged_backend.benchmarks.harness.server_process import start_server
from paged_backend.benchmarks.paper.serving import _model_id
from paged_backend.benchmarks.paper.serving_systems import paged_system, served_model_dir, transformers_system

Threads = Dict[int, Tuple[str, float]]


def thread_cpu(pid: int) -> Threads:
    """tid -> (thread name, user + system CPU seconds) for every thread of `pid`."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: Threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def thread_shares(before: Threads, after: Threads, wall: float) -> List[dict]:
    """Each thread's cores busy between two readings (CPU seconds per wall second), busiest first, every thread
    that used any."""
    busy = sorted(((after[t][1] - before.get(t, (None, 0.0))[1]) / wall, after[t][0], t) for t in after)[::-1]
    return [{"name": name, "tid": tid, "cores": round(b, 3)} for b, name, tid in busy if b > 0]


def drive(base_url: str, body: dict, seconds: float) -> Tuple[int, int]:
    """Streaming completions one after another for `seconds`; returns (requests, streamed chunks)."""
    requests = chunks = 0
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base_url, timeout=120) as client:
        while time.monotonic() < deadline:
            with client.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                chunks += sum(1 for line in reply.iter_lines() if line.startswith("data: {"))
            requests += 1
    return requests, chunks


PROMPT = "Tell me a story about a paged cache. " * 12


def probe(system, seconds: float, output_tokens: int, threads: int, wait_policy: str = "") -> dict:
    """One server under one streaming client for `seconds`: tokens/s and the cores each thread kept busy."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **system.env,
           **({"OMP_WAIT_POLICY": wait_policy} if wait_policy else {})}
    server = start_server(system.argv, env=env, ready_pattern=system.ready_pattern)
    try:
        body = {"model": _model_id(server), "prompt": PROMPT, "max_tokens": output_tokens, "stream": True,
                **system.force_length(output_tokens)}
        drive(server.base_url, body, 3.0)                       # warm-up
        before, start = thread_cpu(server.proc.pid), time.monotonic()
        requests, chunks = drive(server.base_url, body, seconds)
        after, wall = thread_cpu(server.proc.pid), time.monotonic() - start
    finally:
        server.stop()
    threads = thread_shares(before, after, wall)
    return {"system": system.name, "wait_policy": wait_policy or "unset", "wall_s": round(wall, 1),
            "requests": requests, "chunks_per_s": round(chunks / wall, 1),
            "busy_cores": round(sum(t["cores"] for t in threads), 2), "threads": threads}


def _spread(values: List[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def transformers_decode_ms(model, tokenizer, steps: int) -> dict:
    """transformers' own forward, one token at a time after the prompt, with a `DynamicCache`."""
    import torch
    from transformers import DynamicCache

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    times = []
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(steps + 3):
            token = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            times.append((time.perf_counter() - start) * 1000)
    return _spread(times[3:])


def engine_decode_ms(model, tokenizer, steps: int, kv_slots: int) -> dict:
    """Our engine's `step()` for one decoding request."""
    from paged_backend import LLMEngine, SamplingParams

    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=kv_slots // 16, num_swap_blocks=0)
    engine.add_request("one", PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 8))
    for _ in range(4):        # the prefill, then warm decode steps
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
    engine.abort_request("one")
    return _spread(times)


@dataclass
class BusyThreadsConfig:
    model: str = "smollm2"
    seconds: float = 20.0
    output_tokens: int = 64
    threads: int = 2
    kv_slots: int = 3072
    wait_policies: Tuple[str, ...] = ("", "PASSIVE", "ACTIVE")     # "" leaves OMP_WAIT_POLICY unset
    decode_steps: int = 20
    servers: Tuple[str, ...] = ("paged", "hf-serve")


def run_busy_threads(config: BusyThreadsConfig) -> dict:
    threads = set_threads(config.threads)
    model_dir = served_model_dir(config.model)
    systems = [paged_system(model_dir, config.kv_slots, 16, None, "float32"),
               transformers_system(model_dir, config.kv_slots, 16, 2048, "float32")]
    systems = [system for system in systems if system.name in config.servers]
    runs = []
    for policy in config.wait_policies:
        for system in systems:
            runs.append(probe(system, config.seconds, config.output_tokens, config.threads, policy))
            print(f"  {runs[-1]['wait_policy']} {system.name}: {runs[-1]['chunks_per_s']} tokens/s, "
                  f"{runs[-1]['busy_cores']} cores", flush=True)
    model, tokenizer = load_bench_model(config.model)
    in_process = {"transformers": transformers_decode_ms(model, tokenizer, config.decode_steps),
                  "ours": engine_decode_ms(model, tokenizer, config.decode_steps, config.kv_slots)}
    return {"benchmark": "busy-threads", "config": asdict(config), "runs": runs, "in_process_decode_ms": in_process,
            "conditions": {"threads": threads, "inherited_omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}}


def check_busy_threads(result: dict) -> List[str]:
    problems = [f"{r['wait_policy']} {r['system']}: no request finished" for r in result["runs"] if not r["requests"]]
    inherited = result["conditions"]["inherited_omp_wait_policy"]
    if inherited and "" in result["config"]["wait_policies"]:
        problems.append(f"the 'unset' rows inherited OMP_WAIT_POLICY={inherited}")
    return problems


def busy_threads_table(result: dict) -> str:
    c = result["config"]
    rows = [[r["wait_policy"], "ours" if r["system"] == "paged" else "transformers", f"{r['chunks_per_s']:.1f}",
             f"{r['busy_cores']:.2f}", ", ".join(f"{t['cores']:.2f}" for t in r["threads"] if t["cores"] >= 0.05)]
            for r in result["runs"]]
    servers = format_table(["wait policy", "server", "tokens/s", "busy cores", "busiest threads (cores)"], rows,
                           title=f"One streaming client, {c['output_tokens']}-token completions back to back for "
                                 f"{c['seconds']:.0f} s per server; {c['model']} float32, {c['threads']} threads")
    decode = result["in_process_decode_ms"]
    steps = format_table(["in this process", "decode step ms, median (min-max)"], [
        [name, f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f})"] for name, d in (
            ("ours: LLMEngine.step(), one request", decode["ours"]),
            ("transformers: model(...) with a DynamicCache", decode["transformers"]))],
        title=f"One request's decode step, {c['decode_steps']} steps, {c['threads']} threads")
    return servers + "\n\n" + steps


SPEC = BenchmarkSpec("busy-threads", BusyThreadsConfig, run_busy_threads, check_busy_threads, busy_threads_table, "",
                     {"quick": {"model": "tiny-llama", "seconds": 1.0, "output_tokens": 8, "threads": 1,
                                "kv_slots": 512, "wait_policies": ("PASSIVE",), "decode_steps": 3,
                                "servers": ("paged",)},
                      "full": {}},
                     documented_size="full")
