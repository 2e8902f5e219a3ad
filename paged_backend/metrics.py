"""Engine statistics: a snapshot dataclass and the counters behind it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict


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
    num_generated_tokens: int
    num_steps: int
    num_requests_finished: int      # ended without an error (aborted ones included)
    num_requests_failed: int        # ended with an error
    num_requests_aborted: int       # of the finished: aborted by the caller

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


@dataclass
class Counters:
    """Running totals the engine updates every step."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_failed: int = 0
    num_requests_aborted: int = 0
    peak_used_blocks: int = 0
