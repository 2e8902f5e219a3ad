"""Engine statistics: a snapshot dataclass, the counters behind it, and per-request histograms.

The engine observes request latencies and sizes itself (when a request ends, and once per step for the
time between tokens), so every front exports the same values: see `metrics_table.py` for the names.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from paged_backend.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5e6
_COUNT_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
_STEP_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)

# histogram name -> bucket upper bounds (+Inf is implied)
HISTOGRAM_BUCKETS: Dict[str, Tuple[float, ...]] = {
    "time_to_first_token_seconds": _LATENCY_BUCKETS,
    "time_per_output_token_seconds": _LATENCY_BUCKETS,
    "e2e_request_latency_seconds": _LATENCY_BUCKETS,
    "request_queue_time_seconds": _LATENCY_BUCKETS,
    "request_prompt_tokens": _TOKEN_BUCKETS,
    "request_generation_tokens": _TOKEN_BUCKETS,
    "request_params_n": _COUNT_BUCKETS,
    "request_params_best_of": _COUNT_BUCKETS,
    "request_params_max_tokens": _TOKEN_BUCKETS,
    "request_prefill_time_seconds": _LATENCY_BUCKETS,       # first scheduled -> first token
    "request_decode_time_seconds": _LATENCY_BUCKETS,        # first token -> last token
    "request_inference_time_seconds": _LATENCY_BUCKETS,     # first scheduled -> finished
    "request_time_per_output_token_seconds": _LATENCY_BUCKETS,  # a request's decode time per token after the first
    "iteration_tokens": _STEP_TOKEN_BUCKETS,                # tokens run through the model per engine step
}
FINISH_REASONS = ("stop", "length", "abort", "error")
RECENT_VALUES = 4096  # observations each snapshot keeps, for exporters that can only `observe` (Triton)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Counts per bucket (not cumulative; the last one is +Inf), their sum and count, and the most recent
    observed values (oldest first, at most RECENT_VALUES) so that an exporter can replay new ones."""

    buckets: Tuple[float, ...]
    counts: Tuple[int, ...]
    sum: float
    count: int
    # the histogram's log of values when the snapshot was taken, read up to `end` (entries before `end` never
    # change: the histogram appends, and starts a new list when it compacts), so a snapshot per engine step costs
    # no copy of the values
    values: Sequence[float] = field(default=(), repr=False, compare=False)
    end: int = field(default=0, repr=False, compare=False)

    @property
    def recent(self) -> Tuple[float, ...]:
        """The most recent observed values (oldest first, at most RECENT_VALUES)."""
        return tuple(self.values[max(0, self.end - RECENT_VALUES):self.end])

    def cumulative(self) -> Tuple[Tuple[str, int], ...]:
        """(upper bound, observations <= it) pairs, Prometheus style, ending with "+Inf"."""
        pairs, total = [], 0
        for bound, n in zip(tuple(map(str, self.buckets)) + ("+Inf",), self.counts):
            total += n
            pairs.append((bound, total))
        return tuple(pairs)

    def new_values(self, seen: int) -> Tuple[float, ...]:
        """The values observed after the first `seen` ones (as many as are still kept)."""
        missing = min(self.count - seen, RECENT_VALUES)
        if missing <= 0:
            return ()
        return tuple(self.values[max(0, self.end - missing):self.end])


class Histogram:
    """A histogram the engine observes into."""

    def __init__(self, buckets: Tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self._values: List[float] = []
        self._snapshot = None

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
        self._values.append(value)
        if len(self._values) >= 2 * RECENT_VALUES:   # a new list: snapshots keep reading the old one
            self._values = self._values[-RECENT_VALUES:]
        self._snapshot = None

    def snapshot(self) -> HistogramSnapshot:
        if self._snapshot is None:
            self._snapshot = HistogramSnapshot(self.buckets, tuple(self.counts), self.sum, self.count,
                                               self._values, len(self._values))
        return self._snapshot


@dataclass
class EngineStats:
    """A snapshot of the KV cache and the queues (what `get_stats()` returns)."""

    num_blocks: int
    num_free_blocks: int
    num_swap_blocks: int
    num_free_swap_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    kv_usage: float                 # used device blocks / all device blocks
    kv_token_utilization: float     # slots holding tokens / slots in allocated blocks
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cached_prefill_tokens: int  # prompt tokens whose prefill the prefix cache skipped
    num_copy_on_write: int
    peak_used_blocks: int           # most device blocks held at once since the engine started
    max_blocks_per_seq: int         # most device blocks one running sequence holds now
    num_prompt_tokens: int          # tokens run through the model as prefill
    num_recomputed_tokens: int      # of those: tokens computed again after a preemption by recomputation
    num_generated_tokens: int
    num_steps: int
    num_requests_finished: int      # ended without an error (aborted ones included)
    num_requests_failed: int        # ended with an error
    num_requests_aborted: int       # of the finished: aborted by the caller
    swap_usage: float = 0.0         # used host (swap) blocks / all host blocks
    prefix_cache_query_tokens: int = 0  # tokens of the full prompt blocks looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0    # of those, tokens found cached
    # the cache's configuration as label values (vLLM's `cache_config_info`)
    cache_config: Dict[str, str] = field(default_factory=dict)
    # requests that ended, by finish reason ("stop", "length", "abort", "error")
    finish_reasons: Dict[str, int] = field(default_factory=dict)
    # per-request histograms (HISTOGRAM_BUCKETS)
    histograms: Dict[str, HistogramSnapshot] = field(default_factory=dict)
    # the implementation each kernel runs: {"attention": "triton" | "cpp" | "torch", "sampler": "cpp" | "torch"}
    kernels: Dict[str, str] = field(default_factory=dict)
    # LoRA adapters as label values (vLLM's `lora_requests_info`): max_lora, running_lora_adapters,
    # waiting_lora_adapters (comma-separated adapter names)
    lora_info: Dict[str, str] = field(default_factory=dict)
    num_lora_loads: int = 0         # adapters moved into a device slot (LRU swap-ins)
    # speculative decoding (docs/speculative.md): speculating rows verified, draft tokens proposed in them,
    # draft tokens accepted, and accepted / proposed (0 before anything was proposed)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_acceptance_rate: float = 0.0
    timestamp: float = 0.0          # wall-clock time of the snapshot (the value of vLLM's lora_requests_info)

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


@dataclass
class Counters:
    """Running totals the engine updates every step."""

    num_prompt_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_failed: int = 0
    num_requests_aborted: int = 0
    peak_used_blocks: int = 0
    finish_reasons: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    histograms: Dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram(b) for name, b in HISTOGRAM_BUCKETS.items()})

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def histogram_snapshots(self) -> Dict[str, HistogramSnapshot]:
        return {name: h.snapshot() for name, h in self.histograms.items()}


def observe_phases(counters: Counters, m: Any, output: "RequestOutput") -> None:
    """A finished request's phase times (vLLM v1's prefill / decode / inference histograms) from its metrics
    (`RequestMetrics`: first scheduled, first and last token, finished)."""
    if m.first_scheduled_time is None or m.first_token_time is None:
        return
    counters.observe("request_prefill_time_seconds", max(m.first_token_time - m.first_scheduled_time, 0.0))
    counters.observe("request_inference_time_seconds", max(m.finished_time - m.first_scheduled_time, 0.0))
    decode = max((m.last_token_time or m.first_token_time) - m.first_token_time, 0.0)
    counters.observe("request_decode_time_seconds", decode)
    generated = max((len(c.token_ids) for c in output.outputs), default=0)
    if generated > 1:
        counters.observe("request_time_per_output_token_seconds", decode / (generated - 1))


def cache_config_info(cache: Any, kv_size: Any, sliding_window: Optional[int]) -> Dict[str, str]:
    """The KV cache's configuration as strings, the label values of vLLM's `cache_config_info` gauge."""
    return {"block_size": str(cache.block_size), "num_gpu_blocks": str(kv_size.num_blocks),
            "num_cpu_blocks": str(kv_size.num_swap_blocks), "cache_dtype": str(cache.kv_cache_dtype),
            "enable_prefix_caching": str(bool(cache.enable_prefix_caching)),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "sliding_window": str(sliding_window)}
