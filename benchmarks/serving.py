"""Benchmark 4, serving (the paper's Figure 12): Poisson arrivals at several request rates against
the HTTP server, for our engine (`paged-backend serve`) and reservation baselines behind the same app.

Each request streams from the OpenAI `/v1/completions` route with token-id prompts, greedy,
`ignore_eos` and `max_tokens` set to the trace's output length. Per rate we report time to first
token, time per output token, the paper's normalized latency (mean of end-to-end latency / output
tokens) and the throughput achieved. Arrivals stop after `duration` seconds or `max_requests`.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from .engine_runs import load_tokenizer, set_threads
from .report import conditions, format_table
from .server_process import baseline_server_args, paged_server_args, start_server
from .workloads import MAX_TOTAL_TOKENS, TraceRequest, make_trace

PAPER_NOTE = ("paper Fig. 12 (OPT-13B): at the same normalized latency vLLM sustains 1.7x-2.7x the request rate "
              "of Orca (Oracle) and 2.7x-8x that of Orca (Max) on ShareGPT; on Alpaca the gap to Orca (Oracle) "
              "is smaller")


@dataclass
class ServingConfig:
    model: str = "smollm2"
    workload: str = "alpaca"
    rates: Tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 4.0)
    duration_s: float = 30.0
    max_requests: int = 100
    drain_timeout_s: float = 180.0
    kv_slots: int = 1024
    block_size: int = 16
    max_model_len: int = MAX_TOTAL_TOKENS
    baselines: Tuple[str, ...] = ("oracle",)
    seed: int = 0
    threads: Optional[int] = None


QUICK = {"model": "tiny-llama", "rates": (4.0,), "duration_s": 2.0, "max_requests": 8, "drain_timeout_s": 60.0,
         "kv_slots": 1024, "max_model_len": 1024}


@dataclass
class RequestTiming:
    sent: float
    first_token: Optional[float]
    done: float
    output_tokens: int
    error: Optional[str] = None


def arrival_times(rate: float, duration_s: float, max_requests: int, seed: int) -> List[float]:
    """Poisson arrivals: exponential gaps with mean 1/rate, until `duration_s` or `max_requests`."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    while len(times) < max_requests:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        times.append(t)
    return times or [0.0]


async def _one(client, url: str, request: TraceRequest, delay: float) -> RequestTiming:
    await asyncio.sleep(delay)
    body = {"model": "bench", "prompt": list(request.prompt_token_ids), "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, tokens, error = None, 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and first is None:
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("error"):
                        error = str(chunk["error"])[:200]
    except Exception as exc:  # a dropped connection is a failed request, not a crashed benchmark
        error = f"{type(exc).__name__}: {exc}"
    return RequestTiming(sent, first, time.perf_counter(), tokens, error)


async def _run_rate(base_url: str, requests: List[TraceRequest], times: List[float],
                    drain_timeout_s: float) -> List[RequestTiming]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        tasks = [asyncio.ensure_future(_one(client, base_url, r, t)) for r, t in zip(requests, times)]
        done, pending = await asyncio.wait(tasks, timeout=times[-1] + drain_timeout_s)
        for task in pending:
            task.cancel()  # the client disconnects; the server aborts the request and frees its blocks
        await asyncio.gather(*pending, return_exceptions=True)
    now = time.perf_counter()
    return [t.result() if t in done else RequestTiming(0.0, None, now, 0, "timed out") for t in tasks]


def summarize(timings: List[RequestTiming], requests: List[TraceRequest], rate: float) -> dict:
    """Latency and throughput figures of one rate."""
    ok = [(t, r) for t, r in zip(timings, requests) if t.error is None and t.output_tokens == r.output_len]
    if not ok:
        return {"rate": rate, "num_requests": len(timings), "num_finished": 0,
                "errors": [t.error for t in timings if t.error][:3]}
    start = min(t.sent for t in timings if t.sent)
    end = max(t.done for t, _ in ok)
    ttft = [t.first_token - t.sent for t, _ in ok if t.first_token is not None]
    tpot = [(t.done - t.first_token) / (t.output_tokens - 1) for t, _ in ok
            if t.first_token is not None and t.output_tokens > 1]
    normalized = [(t.done - t.sent) / t.output_tokens for t, _ in ok]
    tokens = sum(t.output_tokens for t, _ in ok)
    return {"rate": rate, "num_requests": len(timings), "num_finished": len(ok),
            "throughput_req_s": len(ok) / (end - start), "output_tokens_per_s": tokens / (end - start),
            "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
            "p90_ttft_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))] if ttft else None,
            "mean_tpot_s": statistics.fmean(tpot) if tpot else None,
            "normalized_latency_s_per_token": statistics.fmean(normalized),
            "mean_e2e_s": statistics.fmean(t.done - t.sent for t, _ in ok),
            "errors": [t.error for t in timings if t.error][:3]}


def _serve_and_measure(system: str, args: List[str], trace, config: ServingConfig, env: dict) -> List[dict]:
    server = start_server(args, env)
    try:
        warm = [TraceRequest(trace.requests[0].prompt_token_ids, 4)]
        asyncio.run(_run_rate(server.base_url, warm, [0.0], 120.0))
        rows = []
        for i, rate in enumerate(config.rates):
            times = arrival_times(rate, config.duration_s, min(config.max_requests, len(trace.requests)),
                                  config.seed + i)
            requests = trace.requests[:len(times)]
            timings = asyncio.run(_run_rate(server.base_url, requests, times, config.drain_timeout_s))
            rows.append({"system": system, **summarize(timings, requests, rate)})
            norm = rows[-1].get("normalized_latency_s_per_token")
            print(f"  {system} at {rate} req/s: {rows[-1]['num_finished']}/{len(requests)} done, normalized latency "
                  f"{'-' if norm is None else f'{norm:.3f}'} s/token", flush=True)
        return rows
    finally:
        code = server.stop()
        if code not in (0, None):
            print(f"warning: {system} server exited with {code}:\n{server.tail()}")


def run_serving(config: ServingConfig) -> dict:
    threads = set_threads(config.threads)
    tokenizer = load_tokenizer(config.model)
    count = min(config.max_requests, max(1, int(max(config.rates) * config.duration_s * 2) + 4))
    trace = make_trace(config.workload, tokenizer, count, config.seed)
    env = {"OMP_NUM_THREADS": str(threads), "PAGED_BENCH_THREADS": str(threads)}
    rows = _serve_and_measure("paged", paged_server_args(config.model, config.kv_slots, config.block_size,
                                                         config.max_model_len), trace, config, env)
    for policy in config.baselines:
        rows += _serve_and_measure(policy, baseline_server_args(config.model, policy, config.kv_slots,
                                                                config.max_model_len), trace, config, env)
    return {"benchmark": "serving", "config": asdict(config), "trace": trace.summary(),
            "conditions": conditions(threads=threads), "runs": rows, "paper": PAPER_NOTE}


def serving_table(result: dict) -> str:
    headers = ["system", "rate req/s", "sent", "done", "achieved req/s", "out tok/s", "mean TTFT s", "p90 TTFT s",
               "mean TPOT s", "norm. latency s/tok"]

    def f(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [[r["system"], r["rate"], r["num_requests"], r["num_finished"], f(r.get("throughput_req_s")),
             f(r.get("output_tokens_per_s"), 1), f(r.get("mean_ttft_s")), f(r.get("p90_ttft_s")),
             f(r.get("mean_tpot_s")), f(r.get("normalized_latency_s_per_token"))] for r in result["runs"]]
    c = result["config"]
    title = (f"Serving over HTTP: {result['trace']['name']} requests, Poisson arrivals for {c['duration_s']:.0f} s "
             f"(at most {c['max_requests']}), {c['model']}, {c['kv_slots']} KV slots each")
    return format_table(headers, rows, title)


def check_serving(result: dict) -> List[str]:
    return [f"{r['system']} at {r['rate']} req/s: {r['num_finished']}/{r['num_requests']} finished "
            f"{r.get('errors')}" for r in result["runs"] if r["num_finished"] != r["num_requests"]]


def main(config: ServingConfig, out_dir, plot: bool = True) -> dict:
    """Run, print the table, write serving.json and serving.png under `out_dir`."""
    from .plots import plot_serving
    from .report import run_and_report

    return run_and_report("serving", lambda: run_serving(config), check_serving, serving_table,
                          plot_serving if plot else None, out_dir)
