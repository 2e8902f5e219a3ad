"""Which threads of a server keep the CPU busy at low concurrency: one streaming client sends requests one
after another to ours and to `transformers serve --continuous-batching` (the serving benchmark's systems, same
weights, KV budget and threads), and each thread's CPU seconds are read from /proc/PID/task before and after.

Answers the question the serving benchmark raised: at concurrency 1-4 transformers kept about 1.8 cores busy
where ours kept about one (docs/benchmarks.md, "Why transformers keeps more cores busy"). Run:
`python -m paged_backend.benchmarks.busy_threads [--seconds 20]`, with OMP_WAIT_POLICY set or not.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, Tuple

import httpx

from .server_process import start_server
from .serving import _model_id
from .serving_systems import paged_system, served_model_dir, transformers_system

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


def probe(system, seconds: float, output_tokens: int, threads: int) -> dict:
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **system.env}
    server = start_server(system.argv, env=env, ready_pattern=system.ready_pattern)
    try:
        body = {"model": _model_id(server), "prompt": "Tell me a story about a paged cache. " * 12, "max_tokens": output_tokens,
                "stream": True, **system.force_length(output_tokens)}
        drive(server.base_url, body, 3.0)                       # warm-up
        before, start = thread_cpu(server.proc.pid), time.monotonic()
        requests, chunks = drive(server.base_url, body, seconds)
        after, wall = thread_cpu(server.proc.pid), time.monotonic() - start
    finally:
        server.stop()
    busy = sorted(((after[t][1] - before.get(t, (None, 0.0))[1]) / wall, after[t][0], t) for t in after)[::-1]
    return {"system": system.name, "wall_s": round(wall, 1), "requests": requests, "chunks_per_s": round(chunks / wall, 1),
            "busy_cores": round(sum(b for b, *_ in busy), 2),
            "threads": [{"name": name, "tid": tid, "cores": round(b, 3)} for b, name, tid in busy if b >= 0.01]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_dir = served_model_dir(args.model)
    systems = [paged_system(model_dir, 3072, 16, None, "float32"),
               transformers_system(model_dir, 3072, 16, 2048, "float32")]
    for system in systems:
        print(json.dumps(probe(system, args.seconds, args.output_tokens, args.threads), indent=1))


if __name__ == "__main__":
    main()
