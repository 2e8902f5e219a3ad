"""Engine statistics as Triton custom metrics (`pb_utils.MetricFamily`), served on Triton's /metrics.

Gauges follow the KV cache and the queues; counters follow the engine's running totals (incremented
by the change since the last update, since Triton counters only go up).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from paged_backend.metrics import EngineStats

PREFIX = "paged_backend:"

# metric name -> (description, EngineStats field)
GAUGES: Dict[str, Tuple[str, str]] = {
    "kv_cache_usage_ratio": ("Share of the device KV-cache blocks in use (1 = full).", "kv_usage"),
    "kv_token_utilization": ("Share of the slots of allocated KV blocks that hold a token.", "kv_token_utilization"),
    "num_blocks": ("Device KV-cache blocks in the pool.", "num_blocks"),
    "num_free_blocks": ("Free device KV-cache blocks.", "num_free_blocks"),
    "num_requests_running": ("Requests in the running queue.", "num_running"),
    "num_requests_waiting": ("Requests waiting to be scheduled.", "num_waiting"),
    "num_requests_swapped": ("Requests whose blocks are swapped out to host memory.", "num_swapped"),
}
COUNTERS: Dict[str, Tuple[str, str]] = {
    "num_preemptions_total": ("Requests preempted (swapped or recomputed) because blocks ran out.",
                              "num_preemptions"),
    "prompt_tokens_total": ("Prompt tokens run through the model.", "num_prompt_tokens"),
    "generation_tokens_total": ("Tokens generated.", "num_generated_tokens"),
    "request_success_total": ("Requests that finished (including aborted ones).", "num_requests_finished"),
    "request_failure_total": ("Requests that failed in the engine.", "num_requests_failed"),
}


class TritonEngineMetrics:
    """The metric families and one labelled metric per name; `update(stats)` publishes a snapshot."""

    def __init__(self, pb_utils: Any, labels: Dict[str, str]) -> None:
        self._families: Dict[str, Any] = {}
        self._metrics: Dict[str, Any] = {}
        self._last: Dict[str, float] = {}
        for kind, table in ((pb_utils.MetricFamily.GAUGE, GAUGES), (pb_utils.MetricFamily.COUNTER, COUNTERS)):
            for name, (description, _) in table.items():
                family = pb_utils.MetricFamily(name=PREFIX + name, description=description, kind=kind)
                self._families[name] = family
                self._metrics[name] = family.Metric(labels=labels)

    def update(self, stats: EngineStats) -> None:
        """Set gauges that changed; add the growth of each counter."""
        for name, (_, attr) in GAUGES.items():
            value = float(getattr(stats, attr))
            if self._last.get(name) != value:
                self._metrics[name].set(value)
                self._last[name] = value
        for name, (_, attr) in COUNTERS.items():
            value = float(getattr(stats, attr))
            delta = value - self._last.get(name, 0.0)
            if delta > 0:
                self._metrics[name].increment(delta)
                self._last[name] = value

    def close(self) -> None:
        """Drop the metrics before their families (the order Triton requires)."""
        self._metrics.clear()
        self._families.clear()


def create_metrics(pb_utils: Any, labels: Dict[str, str], logger: Any = None) -> Optional[TritonEngineMetrics]:
    """The metrics, or None when the server runs without metrics (`--allow-metrics=false`)."""
    try:
        return TritonEngineMetrics(pb_utils, labels)
    except Exception as exc:  # noqa: BLE001 - pb_utils raises TritonModelException when metrics are off
        if logger is not None:
            logger.log_info(f"[paged_backend] custom metrics unavailable: {exc}")
        return None
