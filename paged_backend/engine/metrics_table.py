"""The metrics every front exports: one table of (name, help, kind, source in `EngineStats`).

The HTTP server's `/metrics` and the Triton model's custom metrics both read this table, so the same value
has the same name everywhere. Each value is exported under our `paged_backend:` name and, where vLLM has
one, under vLLM's name too (`vllm:num_requests_running`, `vllm:gpu_cache_usage_perc`, ...), so dashboards
and alerts built for vLLM work unchanged. Counter names omit Prometheus' `_total` suffix (see `sample_name`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

from paged_backend.engine.metrics import EngineStats, HistogramSnapshot

GAUGE, COUNTER, HISTOGRAM, INFO = "gauge", "counter", "histogram", "info"  # info: a gauge of 1, labelled
# state: a gauge whose labels describe the engine's current state and whose value is the time it was reported
# (vLLM's lora_requests_info: a series per label set, the newest one current, as inference gateways read it)
STATE = "state"
FINISH_REASON = "finished_reason"


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric. `source` is an `EngineStats` field; for histograms a key of
    `EngineStats.histograms`; with `label`, a dict field whose keys become that label's values; for INFO a
    dict field of label names and values (exported as a gauge of 1); for STATE a dict field of label names and
    values, exported as a gauge valued at the snapshot's `timestamp`."""

    name: str
    help: str
    kind: str
    source: str
    label: Optional[str] = None
    label_values: Tuple[str, ...] = ()

    @property
    def sample_name(self) -> str:
        """The name of the exported sample (`..._total` for counters)."""
        return self.name + "_total" if self.kind == COUNTER else self.name

    @property
    def is_vllm(self) -> bool:
        return self.name.startswith("vllm:")


def _ours(name: str, help: str, kind: str, source: str, **extra) -> MetricSpec:
    return MetricSpec("paged_backend:" + name, help, kind, source, **extra)


def _vllm(name: str, help: str, kind: str, source: str, **extra) -> MetricSpec:
    return MetricSpec("vllm:" + name, help, kind, source, **extra)


_REASONS = ("stop", "length", "abort", "error")

METRICS: Tuple[MetricSpec, ...] = (
    # ---- ours ----
    _ours("kv_cache_usage", "Fraction of device KV blocks in use (0-1)", GAUGE, "kv_usage"),
    _ours("kv_token_utilization", "Fraction of slots in allocated KV blocks that hold a token (0-1)", GAUGE,
          "kv_token_utilization"),
    _ours("kv_blocks_free", "Free device KV blocks", GAUGE, "num_free_blocks"),
    _ours("kv_blocks_total", "Device KV blocks", GAUGE, "num_blocks"),
    _ours("kv_block_size", "Tokens per KV block", GAUGE, "block_size"),
    _ours("swap_blocks_free", "Free host (swap) KV blocks", GAUGE, "num_free_swap_blocks"),
    _ours("swap_blocks_total", "Host (swap) KV blocks", GAUGE, "num_swap_blocks"),
    _ours("num_requests_running", "Requests in the running queue", GAUGE, "num_running"),
    _ours("num_requests_waiting", "Requests in the waiting queue", GAUGE, "num_waiting"),
    _ours("num_requests_swapped", "Requests swapped out to host memory", GAUGE, "num_swapped"),
    _ours("prefix_cache_hit_rate", "Prefix-cache hits per query (0-1)", GAUGE, "prefix_cache_hit_rate"),
    _ours("num_preemptions", "Requests preempted (swap or recompute)", COUNTER, "num_preemptions"),
    _ours("num_swap_preemptions", "Preemptions that swapped blocks to host memory", COUNTER,
          "num_swap_preemptions"),
    _ours("num_recompute_preemptions", "Preemptions that dropped blocks for recomputation", COUNTER,
          "num_recompute_preemptions"),
    _ours("prefix_cache_queries", "Prefix-cache lookups (full prompt blocks)", COUNTER, "prefix_cache_queries"),
    _ours("prefix_cache_hits", "Prefix-cache hits (full prompt blocks)", COUNTER, "prefix_cache_hits"),
    _ours("copy_on_write", "Shared KV blocks copied on first write", COUNTER, "num_copy_on_write"),
    _ours("prompt_tokens", "Prompt tokens run through the model as prefill (recomputation included)", COUNTER,
          "num_prompt_tokens"),
    _ours("cached_prompt_tokens", "Prompt tokens whose prefill the prefix cache skipped", COUNTER,
          "num_cached_prefill_tokens"),
    _ours("generation_tokens", "Tokens generated", COUNTER, "num_generated_tokens"),
    _ours("engine_steps", "Engine steps run", COUNTER, "num_steps"),
    _ours("requests_finished", "Requests the engine finished (aborted ones included)", COUNTER,
          "num_requests_finished"),
    _ours("requests_failed", "Requests the engine failed", COUNTER, "num_requests_failed"),
    _ours("requests_aborted", "Requests aborted before they finished (client gone, cancelled, shutdown)", COUNTER,
          "num_requests_aborted"),
    _ours("request_finished", "Requests that ended, by finish reason", COUNTER, "finish_reasons",
          label=FINISH_REASON, label_values=_REASONS),
    _ours("time_to_first_token_seconds", "Arrival to first generated token", HISTOGRAM,
          "time_to_first_token_seconds"),
    _ours("time_per_output_token_seconds", "Time between a request's successive steps with new tokens", HISTOGRAM,
          "time_per_output_token_seconds"),
    _ours("e2e_request_latency_seconds", "Arrival to finish, per request", HISTOGRAM, "e2e_request_latency_seconds"),
    _ours("lora_slot_loads", "LoRA adapters moved into a device slot (the first use of an adapter, or its turn "
          "again after the slot went to another)", COUNTER, "num_lora_loads"),
    _ours("spec_decode_acceptance_rate", "Accepted draft tokens per proposed draft token (speculative decoding, "
          "0-1)", GAUGE, "spec_decode_acceptance_rate"),
    _ours("kernel_info", "The kernels in use: attention triton, cpp or torch; sampler cpp or torch; linear_rows "
          "(compiled linear layers our kernel serves) cpp or torch (torch when the C++ kernels could not be built); "
          "attend_layer (compiled attention layers) cpp or python",
          INFO, "kernels"),
    # ---- vLLM's names for the same values ----
    _vllm("num_requests_running", "Number of requests currently running", GAUGE, "num_running"),
    _vllm("num_requests_waiting", "Number of requests waiting to be processed", GAUGE, "num_waiting"),
    _vllm("num_requests_swapped", "Number of requests swapped to CPU", GAUGE, "num_swapped"),
    _vllm("gpu_cache_usage_perc", "KV-cache usage of the device; 1 means 100 percent usage", GAUGE, "kv_usage"),
    _vllm("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent usage", GAUGE, "kv_usage"),
    _vllm("cpu_cache_usage_perc", "Host (swap) KV-cache usage; 1 means 100 percent usage", GAUGE, "swap_usage"),
    _vllm("gpu_prefix_cache_hit_rate", "Prefix-cache block hit rate", GAUGE, "prefix_cache_hit_rate"),
    _vllm("num_preemptions", "Cumulative number of preemptions", COUNTER, "num_preemptions"),
    _vllm("prompt_tokens", "Number of prefill tokens processed", COUNTER, "num_prompt_tokens"),
    _vllm("generation_tokens", "Number of generation tokens processed", COUNTER, "num_generated_tokens"),
    _vllm("request_success", "Count of successfully processed requests", COUNTER, "finish_reasons",
          label=FINISH_REASON, label_values=("stop", "length", "abort")),
    _vllm("time_to_first_token_seconds", "Histogram of time to first token in seconds", HISTOGRAM,
          "time_to_first_token_seconds"),
    _vllm("time_per_output_token_seconds", "Histogram of time per output token in seconds", HISTOGRAM,
          "time_per_output_token_seconds"),
    _vllm("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds", HISTOGRAM,
          "e2e_request_latency_seconds"),
    _vllm("request_queue_time_seconds", "Histogram of time spent waiting before the first step", HISTOGRAM,
          "request_queue_time_seconds"),
    _vllm("request_prompt_tokens", "Number of prefill tokens processed", HISTOGRAM, "request_prompt_tokens"),
    _vllm("request_generation_tokens", "Number of generation tokens processed", HISTOGRAM,
          "request_generation_tokens"),
    _vllm("request_params_n", "Histogram of the n request parameter", HISTOGRAM, "request_params_n"),
    _vllm("request_params_best_of", "Histogram of the best_of request parameter (beam width for beam search)",
          HISTOGRAM, "request_params_best_of"),
    # ---- vLLM v1's series (tokens where v1 counts tokens) ----
    _vllm("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens (full prompt blocks)",
          COUNTER, "prefix_cache_query_tokens"),
    _vllm("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens", COUNTER,
          "prefix_cache_hit_tokens"),
    _vllm("prompt_tokens_cached", "Number of cached prompt tokens", COUNTER, "num_cached_prefill_tokens"),
    _vllm("inter_token_latency_seconds", "Histogram of inter-token latency in seconds", HISTOGRAM,
          "time_per_output_token_seconds"),
    _vllm("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request",
          HISTOGRAM, "request_time_per_output_token_seconds"),
    _vllm("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request", HISTOGRAM,
          "request_prefill_time_seconds"),
    _vllm("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request", HISTOGRAM,
          "request_decode_time_seconds"),
    _vllm("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request", HISTOGRAM,
          "request_inference_time_seconds"),
    _vllm("iteration_tokens_total", "Histogram of number of tokens per engine_step", HISTOGRAM, "iteration_tokens"),
    _vllm("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens",
          HISTOGRAM, "request_params_max_tokens"),
    _vllm("request_params_max_tokens", "Histogram of the max_tokens request parameter", HISTOGRAM,
          "request_params_max_tokens"),
    _vllm("spec_decode_num_drafts", "Number of spec decoding drafts (speculating rows verified)", COUNTER,
          "spec_decode_num_drafts"),
    _vllm("spec_decode_num_draft_tokens", "Number of draft tokens", COUNTER, "spec_decode_num_draft_tokens"),
    _vllm("spec_decode_num_accepted_tokens", "Number of accepted tokens", COUNTER,
          "spec_decode_num_accepted_tokens"),
    _vllm("cache_config_info", "Information of the LLMEngine CacheConfig", INFO, "cache_config"),
    _vllm("lora_requests_info", "Running stats on lora requests.", STATE, "lora_info"),
)


def value(spec: MetricSpec, stats: EngineStats) -> float:
    """A gauge's or unlabelled counter's current value."""
    return float(getattr(stats, spec.source))


def labelled_values(spec: MetricSpec, stats: EngineStats) -> Iterator[Tuple[str, float]]:
    """(label value, count) of a labelled counter."""
    counts: Dict[str, int] = getattr(stats, spec.source)
    for label in spec.label_values:
        yield label, float(counts.get(label, 0))


def info_labels(spec: MetricSpec, stats: EngineStats) -> Dict[str, str]:
    """The label names and values of an INFO or STATE metric."""
    return dict(getattr(stats, spec.source))


def state_value(stats: EngineStats) -> float:
    """The value of a STATE metric's current series: the snapshot's wall-clock time (vLLM sets it so too)."""
    return float(stats.timestamp)


def histogram(spec: MetricSpec, stats: EngineStats) -> HistogramSnapshot:
    return stats.histograms[spec.source]
