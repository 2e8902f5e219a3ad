"""Where every KV slot goes, step by step: the paper's Figure 2 categories measured on a running engine.

A `MemoryLedger` wraps the scheduler of an `LLMEngine` (without changing what it does) and, after
each schedule, classifies the slots of the cache:
- token states: slots that hold (or this step write) a token's K/V,
- reserved: slots held for tokens the request will produce later,
- internal fragmentation: held slots beyond the request's final length (never used),
- external fragmentation: free slots while the next waiting request cannot be admitted only because
  no contiguous run is large enough (paging has none by construction),
- idle: other free slots (nothing waits, or the next request needs more than all free slots).
Final lengths are known because benchmark requests are forced to their trace length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from paged_backend.core.block_manager import HOLE
from paged_backend.core.sequence import SequenceGroup

from paged_backend.benchmarks.paper.reservation import ReservationBlockManager


@dataclass
class KVTally:
    """Slot counts summed over the steps of a run."""

    token_states: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0
    idle: int = 0
    steps: int = 0
    batched_requests: int = 0
    batched_seqs: int = 0

    @property
    def wasted_or_used(self) -> int:
        return self.token_states + self.reserved + self.internal + self.external

    def shares(self) -> Dict[str, float]:
        """Each category's share of the memory in use or lost to fragmentation (the paper's Figure 2 bars)."""
        total = self.wasted_or_used
        if not total:
            return {"token_states": 0.0, "reserved": 0.0, "internal": 0.0, "external": 0.0}
        return {"token_states": self.token_states / total, "reserved": self.reserved / total,
                "internal": self.internal / total, "external": self.external / total}

    @property
    def avg_batch_requests(self) -> float:
        return self.batched_requests / self.steps if self.steps else 0.0

    @property
    def avg_batch_seqs(self) -> float:
        return self.batched_seqs / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(shares=self.shares(), avg_batch_requests=self.avg_batch_requests,
                    avg_batch_seqs=self.avg_batch_seqs,
                    idle_share_of_cache=self.idle / (self.idle + self.wasted_or_used)
                    if self.idle + self.wasted_or_used else 0.0)
        return data


def final_length(group: SequenceGroup, max_model_len: int) -> int:
    """The length a forced-length request ends at: prompt + max_tokens, capped by the context."""
    max_tokens = group.sampling_params.max_tokens
    if max_tokens is None:
        return max_model_len
    return min(max_model_len, len(group.prompt_token_ids) + max_tokens)


def _span_use(lo: int, hi: int, length: int, final: int) -> Tuple[int, int]:
    """Slots of positions [lo, hi) holding tokens (below `length`) and reserved (from `length` to `final`)."""
    used = max(0, min(hi, length) - lo)
    return used, max(0, min(hi, final) - max(lo, length))


def _slot_use(table: List[int], block_size: int, length: int, final: int) -> Tuple[int, int, int]:
    """(slots holding tokens, slots reserved for tokens still to come, slots never to be used) of the blocks a
    sequence holds; released positions of a sliding-window sequence (holes) hold nothing. Closed form over
    the whole table, less the holes (a reservation's table has one entry per slot: no per-slot loop)."""
    held = len(table) * block_size
    tokens, reserved = _span_use(0, held, length, final)
    if HOLE in table:
        for i, block in enumerate(table):
            if block == HOLE:
                hole_tokens, hole_reserved = _span_use(i * block_size, (i + 1) * block_size, length, final)
                tokens, reserved, held = tokens - hole_tokens, reserved - hole_reserved, held - block_size
    return tokens, reserved, held - tokens - reserved


def _admission_need(bm, group: SequenceGroup) -> int:
    if isinstance(bm, ReservationBlockManager):
        return bm.blocks_needed(group)
    return bm.admission_blocks(group)


def _largest_run(bm) -> int:
    if isinstance(bm, ReservationBlockManager):
        return bm.largest_free_run()
    return bm.get_num_free_blocks()  # paged: any free blocks will do


class StepObserver:
    """Wraps an engine's `scheduler.schedule` so that `record()` runs after every step that schedules
    work (the moment a step holds the most blocks); `detach()` restores it. The engine runs unchanged."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._schedule_and_record

    def detach(self) -> None:
        self.engine.scheduler.schedule = self._schedule

    def _schedule_and_record(self):
        out = self._schedule()
        if out.scheduled:
            self.record()
        return out

    def record(self) -> None:
        raise NotImplementedError


class MemoryLedger(StepObserver):
    """Attach to an engine before its requests run; `tally` accumulates every scheduled step."""

    def __init__(self, engine) -> None:
        self.tally = KVTally()
        super().__init__(engine)

    def record(self) -> None:
        engine = self.engine
        bm, scheduler = engine.block_manager, engine.scheduler
        bs = bm.block_size
        t = self.tally
        seqs = 0
        for group in scheduler.running:
            final = final_length(group, engine.max_model_len)
            for seq in group.unfinished_seqs():
                table = bm.block_tables.get(seq.seq_id)
                if not table:
                    continue
                seqs += 1
                tokens, reserved, internal = _slot_use(table, bs, len(seq), final)
                t.token_states += tokens
                t.reserved += reserved
                t.internal += internal
        free_slots = bm.get_num_free_blocks() * bs
        external = 0
        head: Optional[SequenceGroup] = scheduler.waiting[0] if scheduler.waiting else None
        if head is not None and free_slots:
            need = _admission_need(bm, head)
            if need * bs <= free_slots and _largest_run(bm) < need:
                external = free_slots
        t.external += external
        t.idle += free_slots - external
        t.steps += 1
        t.batched_requests += len(scheduler.running)
        t.batched_seqs += seqs
