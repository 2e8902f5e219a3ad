"""Reservation baselines run through the same engine: a block manager that reserves contiguous capacity up front.

Systems without paging (the paper emulates Orca) give each request, when it is admitted, one
contiguous run of KV slots big enough for everything it might generate:
- "max": the maximum sequence length (2048 tokens on the paper's models and our trace filter),
- "pow2": the prompt plus the next power of two of the true output length (at most 2x over),
- "oracle": the prompt plus the true output length.
The run comes from a real contiguous allocator over the cache (first-fit or buddy), so holes between
reservations are external fragmentation. Everything else (scheduler, model runner, sampler) is the
engine's own: `install_reservation` swaps the block manager of an engine that has no requests yet.
Run the engine with block_size=1 for slot-exact reservations (a contiguous system has no blocks).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from paged_backend.core.block_manager import AllocStatus, BlockManager
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus

from paged_backend.benchmarks.paper.contiguous import make_arena

POLICIES = ("max", "pow2", "oracle")


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def reservation_tokens(policy: str, prompt_len: int, max_tokens, max_len: int) -> int:
    """Slots a request reserves on admission under `policy`; without a known output length, `max_len`."""
    if policy not in POLICIES:
        raise ValueError(f"unknown reservation policy {policy!r}; use one of {POLICIES}")
    if policy == "max" or max_tokens is None:
        return max_len
    output = next_power_of_two(max_tokens) if policy == "pow2" else max_tokens
    return min(max_len, prompt_len + output)


class ReservationBlockManager(BlockManager):
    """A block manager whose block tables are contiguous runs reserved whole when a request is admitted."""

    batched_decode = False  # its own slot rules: every step goes through can_append_slots / append_slots

    def __init__(self, block_size: int, num_blocks: int, policy: str, max_len: int,
                 allocator: str = "first-fit") -> None:
        super().__init__(block_size, num_blocks, num_swap_blocks=0, watermark=0.0, enable_prefix_caching=False)
        reservation_tokens(policy, 1, 1, max_len)  # validates the policy name
        self.policy = policy
        self.max_len = max_len
        self.arena = make_arena(allocator, num_blocks)
        self.regions: Dict[int, int] = {}  # seq_id -> first block of its reservation

    # ---- sizes ---------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.arena.free_units

    def largest_free_run(self) -> int:
        """The largest contiguous run of free blocks (what the next reservation can get)."""
        return self.arena.largest_free()

    def blocks_needed(self, group: SequenceGroup) -> int:
        """Blocks the request's reservation occupies (buddy rounds up to a power of two)."""
        params = group.sampling_params
        tokens = reservation_tokens(self.policy, len(group.prompt_token_ids), params.max_tokens, self.max_len)
        return self.arena.granted_units(self.blocks_for(tokens))

    # ---- admission -----------------------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        if group.sampling_params.num_branches > 1 or len(group.seqs) > 1:
            return AllocStatus.NEVER  # reservation baselines run one sequence per request
        needed = self.blocks_needed(group)
        if needed > self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if needed <= self.arena.largest_free() else AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        params = group.sampling_params
        for seq in group.get_seqs(SequenceStatus.WAITING):
            if seq.seq_id in self.block_tables:
                raise ValueError(f"sequence {seq.seq_id} already has a block table")
            tokens = reservation_tokens(self.policy, len(group.prompt_token_ids), params.max_tokens, self.max_len)
            got = self.arena.allocate(self.blocks_for(tokens))
            if got is None:
                raise RuntimeError("allocate() called for a reservation that does not fit; check can_allocate")
            start, units = got
            self.regions[seq.seq_id] = start
            self.block_tables[seq.seq_id] = list(range(start, start + units))
            seq.num_computed_tokens = 0

    # ---- growth: never beyond the reservation ----------------------------------------------
    def can_append_slots(self, group: SequenceGroup) -> bool:
        return self.num_blocks_to_append(group.get_seqs(SequenceStatus.RUNNING)) == 0

    def append_slots(self, seq: Sequence) -> List[Tuple[int, int]]:
        if self.blocks_for(seq.len_with_pending) > len(self.block_tables[seq.seq_id]):
            raise RuntimeError(f"sequence {seq.seq_id} outgrew its reservation")
        return []

    def kv_usage(self, seqs) -> Tuple[int, int]:
        """A reservation holds slots beyond its last token: walk the tables (no O(1) shortcut here)."""
        return self.token_slot_usage(seqs)

    def fork(self, parent: Sequence, child: Sequence, num_tokens=None) -> None:
        raise ValueError("the reservation baseline runs one sequence per request (no n > 1 or beam search)")

    def free(self, seq: Sequence) -> None:
        self._num_registered.pop(seq.seq_id, None)
        table = self.block_tables.pop(seq.seq_id, None)
        if table is not None:
            self.arena.free(self.regions.pop(seq.seq_id))

    # ---- no swapping: a preempted request gives its reservation back and is recomputed --------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False


def install_reservation(engine, policy: str, allocator: str = "first-fit") -> ReservationBlockManager:
    """Make a fresh `LLMEngine` reserve contiguous capacity per request; returns the new block manager."""
    if engine.has_unfinished_requests():
        raise ValueError("install the reservation manager before adding requests")
    if engine.config.parallel.tensor_parallel_size != 1:
        raise ValueError("the reservation baseline runs on one rank")
    old = engine.block_manager
    manager = ReservationBlockManager(old.block_size, old.num_blocks, policy, engine.max_model_len, allocator)
    engine.config.cache.enable_prefix_caching = False  # a reservation shares nothing, cached prefixes included
    engine.block_manager = manager
    engine.scheduler.block_manager = manager
    return manager
