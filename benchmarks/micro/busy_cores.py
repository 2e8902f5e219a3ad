"""How many of the machine's cores our server keeps busy at each concurrency, with a client too light to compete
for them: streaming completions back to back from threads of this process (httpx, no load generator), each server
thread's CPU seconds read from /proc/PID/task, beside this process's own (the clients) and the whole machine's.

Under guidellm (the serving benchmark) the load generator runs on the same cores: there the server's busy cores
are what guidellm leaves (its rows' `machine cores` say how many the machine used in all). This study measures
the server alone at every concurrency. Run: `paged-backend bench busy-cores --documented` (record:
docs/measurements/busy-cores.json).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import List, Tuple

from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table
from paged_backend.benchmarks.harness.server_process import machine_cpu_seconds, start_server
from paged_backend.benchmarks.micro.busy_threads import PROMPT, drive, thread_cpu, thread_shares
from paged_backend.benchmarks.paper.engine_runs import set_threads
from paged_backend.benchmarks.paper.serving import _model_id
from paged_backend.benchmarks.paper.serving_systems import paged_system, served_model_dir


@dataclass
class BusyCoresConfig:
    model: str = "smollm2"
    dtypes: Tuple[str, ...] = ("float32", "bfloat16")
    concurrencies: Tuple[int, ...] = (1, 4, 16, 32)
    seconds: float = 20.0         # of streaming per concurrency
    output_tokens: int = 64
    threads: int = 2
    kv_slots: int = 3072
    compiled: bool = True          # the server as the serving records' `paged-compiled` (`--compile blocking`)


def _cpu_now() -> float:
    """This process's CPU seconds, all its threads (the streaming clients)."""
    return time.process_time()


def sweep(server, body: dict, concurrencies: Tuple[int, ...], seconds: float) -> List[dict]:
    """Each concurrency in turn: that many threads streaming completions back to back for `seconds`."""
    rows = []
    for clients in concurrencies:
        counts: List[Tuple[int, int]] = [(0, 0)] * clients

        def stream(i: int) -> None:
            counts[i] = drive(server.base_url, body, seconds)

        workers = [threading.Thread(target=stream, args=(i,)) for i in range(clients)]
        before, own, machine, start = thread_cpu(server.proc.pid), _cpu_now(), machine_cpu_seconds(), time.monotonic()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        wall = time.monotonic() - start
        after, own_after, machine_after = thread_cpu(server.proc.pid), _cpu_now(), machine_cpu_seconds()
        threads = thread_shares(before, after, wall)
        rows.append({"concurrency": clients, "wall_s": round(wall, 1), "requests": sum(r for r, _ in counts),
                     "tokens_per_s": round(sum(c for _, c in counts) / wall, 1),
                     "busy_cores": round(sum(t["cores"] for t in threads), 3),
                     "client_cores": round((own_after - own) / wall, 3),
                     "machine_cores": None if machine is None or machine_after is None
                     else round((machine_after - machine) / wall, 3), "threads": threads})
    return rows


def run_busy_cores(config: BusyCoresConfig) -> dict:
    threads = set_threads(config.threads)
    model_dir = served_model_dir(config.model)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    runs = []
    for dtype in config.dtypes:
        system = paged_system(model_dir, config.kv_slots, 16, None, dtype, compiled=config.compiled)
        server = start_server(system.argv, env=env, ready_timeout=system.ready_timeout_s,
                              ready_pattern=system.ready_pattern)
        try:
            body = {"model": _model_id(server), "prompt": PROMPT, "max_tokens": config.output_tokens, "stream": True,
                    **system.force_length(config.output_tokens)}
            drive(server.base_url, body, 3.0)   # warm-up
            for row in sweep(server, body, config.concurrencies, config.seconds):
                runs.append({"dtype": dtype, "system": system.name, **row})
                print(f"  {dtype} concurrency {row['concurrency']}: {row['tokens_per_s']} tokens/s, server "
                      f"{row['busy_cores']} cores, clients {row['client_cores']}, machine {row['machine_cores']}",
                      flush=True)
        finally:
            server.stop()
    return {"benchmark": "busy-cores", "config": asdict(config), "runs": runs, "conditions": {"threads": threads}}


def check_busy_cores(result: dict) -> List[str]:
    return [f"{r['dtype']} concurrency {r['concurrency']}: no request finished" for r in result["runs"]
            if not r["requests"]]


def busy_cores_table(result: dict) -> str:
    c = result["config"]
    rows = [[r["dtype"], r["concurrency"], f"{r['tokens_per_s']:.1f}", f"{r['busy_cores']:.2f}",
             ", ".join(f"{t['cores']:.2f}" for t in r["threads"] if t["cores"] >= 0.05), f"{r['client_cores']:.2f}",
             "-" if r["machine_cores"] is None else f"{r['machine_cores']:.2f}"] for r in result["runs"]]
    server = "compiled (--compile blocking)" if c["compiled"] else "eager"
    return format_table(["dtype", "concurrency", "tokens/s", "server cores", "busiest threads (cores)",
                         "client cores", "machine cores"], rows,
                        title=f"Our server, {server}, {c['model']}, {c['threads']} threads: streaming clients in "
                              f"threads of one process, {c['output_tokens']}-token completions back to back for "
                              f"{c['seconds']:.0f} s per concurrency; cores = CPU seconds per second")


SPEC = BenchmarkSpec("busy-cores", BusyCoresConfig, run_busy_cores, check_busy_cores, busy_cores_table, "",
                     {"quick": {"model": "tiny-llama", "dtypes": ("float32",), "concurrencies": (1, 2),
                                "seconds": 1.0, "output_tokens": 8, "threads": 1, "kv_slots": 512, "compiled": False},
                      "full": {}},
                     documented_size="full")
