"""Prometheus metrics for one server, names prefixed `paged_backend:`.

Engine gauges and counters are read from `AsyncLLMEngine.get_stats()` at scrape time; latency
histograms are observed by the HTTP layer when a request finishes. Each app has its own
`CollectorRegistry`, so several servers in one process do not clash.
"""

from __future__ import annotations

from typing import Iterator, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from paged_backend import AsyncLLMEngine, RequestOutput

PREFIX = "paged_backend:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# (name, help, EngineStats field)
_GAUGES = (
    ("kv_cache_usage", "Fraction of device KV blocks in use (0-1)", "kv_usage"),
    ("kv_token_utilization", "Fraction of slots in allocated KV blocks that hold a token (0-1)",
     "kv_token_utilization"),
    ("kv_blocks_free", "Free device KV blocks", "num_free_blocks"),
    ("kv_blocks_total", "Device KV blocks", "num_blocks"),
    ("kv_block_size", "Tokens per KV block", "block_size"),
    ("swap_blocks_free", "Free host (swap) KV blocks", "num_free_swap_blocks"),
    ("swap_blocks_total", "Host (swap) KV blocks", "num_swap_blocks"),
    ("num_requests_running", "Requests in the running queue", "num_running"),
    ("num_requests_waiting", "Requests in the waiting queue", "num_waiting"),
    ("num_requests_swapped", "Requests swapped out to host memory", "num_swapped"),
    ("prefix_cache_hit_rate", "Prefix-cache hits per query (0-1)", "prefix_cache_hit_rate"),
)
_COUNTERS = (
    ("num_preemptions", "Requests preempted (swap or recompute)", "num_preemptions"),
    ("num_swap_preemptions", "Preemptions that swapped blocks to host memory", "num_swap_preemptions"),
    ("num_recompute_preemptions", "Preemptions that dropped blocks for recomputation",
     "num_recompute_preemptions"),
    ("prefix_cache_queries", "Prefix-cache lookups", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prefix-cache hits", "prefix_cache_hits"),
    ("copy_on_write", "Shared KV blocks copied on first write", "num_copy_on_write"),
    ("prompt_tokens", "Prompt tokens run through the model as prefill (recomputation included)",
     "num_prompt_tokens"),
    ("cached_prompt_tokens", "Prompt tokens whose prefill the prefix cache skipped", "num_cached_prefill_tokens"),
    ("generation_tokens", "Tokens generated", "num_generated_tokens"),
    ("engine_steps", "Engine steps run", "num_steps"),
    ("requests_finished", "Requests the engine finished (aborted ones included)", "num_requests_finished"),
    ("requests_failed", "Requests the engine failed", "num_requests_failed"),
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class _EngineStatsCollector:
    """Reads the engine's statistics at scrape time."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.get_stats()
        for name, doc, attr in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(getattr(stats, attr)))
        for name, doc, attr in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=float(getattr(stats, attr)))


def _elapsed(metrics: dict, start: str, end: str) -> Optional[float]:
    a, b = metrics.get(start), metrics.get(end)
    return None if a is None or b is None else max(b - a, 0.0)


class ServerMetrics:
    """The registry behind `/metrics` for one app."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineStatsCollector(engine))
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds", "Mean time between generated tokens, per request",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish, per request",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter(
            PREFIX + "request_finished", "Requests finished, by finish reason", ["finished_reason"],
            registry=self.registry)

    def observe_finished(self, output: RequestOutput) -> None:
        """Record one finished request's latencies and finish reason."""
        m = output.metrics or {}
        ttft = _elapsed(m, "arrival_time", "first_token_time")
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        decode = _elapsed(m, "first_token_time", "last_token_time")
        if decode is not None and longest > 1:
            self.time_per_output_token.observe(decode / (longest - 1))
        e2e = _elapsed(m, "arrival_time", "finished_time")
        if e2e is not None:
            self.e2e_latency.observe(e2e)
        reasons = {c.finish_reason or "abort" for c in output.outputs} or {"abort"}
        if output.error is not None:
            reasons = {"error"}
        for reason in reasons:
            self.requests.labels(finished_reason=reason).inc()

    def observe_aborted(self) -> None:
        """A request that ended before finishing (client gone, server shutting down)."""
        self.requests.labels(finished_reason="abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
