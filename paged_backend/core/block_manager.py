"""Block tables: which physical KV blocks hold each sequence's tokens.

Blocks are allocated only when a token needs a slot, shared by reference count between forked
sequences and between requests with a cached common prefix, copied on the first write into a
shared block, and moved whole between the device pool and the host swap pool. A block shared on
the device is shared on the host too: it is swapped once per step, to one host block.

For a model whose every layer attends through a sliding window of W tokens, blocks that lie wholly
before a sequence's last W tokens are released as it advances: their table positions stay, as holes
(`HOLE`), so a long generation holds O(W) blocks rather than O(length). Such a sequence is also admitted
with only the blocks its next token reads (its window, when the prefix cache holds it) and gets the slots of
a longer prefill chunk from the blocks free at that step (`grow_for_chunk`): recomputing a long sequence
after a preemption never needs a block per token.
"""

from __future__ import annotations

import enum
from typing import Dict, Iterable, List, Optional, Tuple

from paged_backend.core.block_allocator import BlockAllocator
from paged_backend.core.prefix_cache import PrefixCache, hash_block
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus


HOLE = -1  # a table position whose block was released (outside every layer's window); never read


class AllocStatus(enum.Enum):
    OK = "ok"        # admit now
    LATER = "later"  # wait for blocks to free up
    NEVER = "never"  # does not fit even in an empty cache: reject


class BlockManager:
    """Maps each sequence's logical blocks to physical blocks of the device or host pool."""

    batched_decode = True  # `append_decode_slots` may serve a step (a subclass that changes slot rules says no)

    def __init__(self, block_size: int, num_blocks: int, num_swap_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False,
                 sliding_window: Optional[int] = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's keys lie within this many tokens (None: all)
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.device = BlockAllocator(num_blocks, "device", self.prefix_cache)
        self.host = BlockAllocator(num_swap_blocks, "host")
        self.block_tables: Dict[int, List[int]] = {}       # seq_id -> device blocks
        self.swapped_tables: Dict[int, List[int]] = {}     # seq_id -> host blocks
        self._num_registered: Dict[int, int] = {}          # seq_id -> leading blocks in the prefix cache
        self._num_released: Dict[int, int] = {}            # seq_id -> leading table positions that are holes
        self.num_cached_prefill_tokens = 0                 # prompt tokens whose prefill the cache skipped
        self.num_copy_on_write = 0

    # ---- sizes -----------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_num_free_blocks(self) -> int:
        return self.device.get_num_free_blocks()

    def get_num_free_swap_blocks(self) -> int:
        return self.host.get_num_free_blocks()

    def _status(self, needed: int, needed_if_empty: int) -> AllocStatus:
        """OK / LATER / NEVER for a request that needs `needed` free blocks now (`needed_if_empty` when
        nothing else holds any), keeping the watermark free."""
        if needed_if_empty > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_blocks() - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _needed_len(self, seq: Sequence) -> int:
        """Tokens that must have slots before a step: all of them; under a sliding window only up to the next
        one to compute (a prefill chunk's further slots come from `grow_for_chunk`)."""
        if self.sliding_window is None:
            return seq.len_with_pending
        return min(seq.len_with_pending, seq.num_computed_tokens + 1)

    # ---- admission ---------------------------------------------------------------------------
    def admission_blocks(self, group: SequenceGroup) -> int:
        """Blocks a waiting request holds once admitted (and its siblings forked, when it is being recomputed)."""
        if self.sliding_window is not None:
            return self._windowed_admission_blocks(group)
        needed = sum(self.blocks_for(len(seq)) for seq in group.active_seqs())
        shared = group.fork_pending_len
        if shared is not None:
            needed += sum(self.blocks_for(len(seq)) - shared // self.block_size for seq in group.pending_forks())
        return needed

    def _windowed_admission_blocks(self, group: SequenceGroup) -> int:
        """Under a sliding window a sequence starts with at most its window's cached blocks (with a prefix cache)
        and one block to compute in; a pending fork takes one block (its own, or a copy of the shared one)."""
        per_seq = 1 + (self.blocks_for(self.sliding_window - 1) if self.prefix_cache is not None else 0)
        return sum(min(self.blocks_for(len(seq)), per_seq) for seq in group.active_seqs()) + len(group.pending_forks())

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether a waiting request can get blocks for all of its tokens."""
        needed = self.admission_blocks(group)
        return self._status(needed, needed)

    def allocate(self, group: SequenceGroup) -> None:
        """Block tables for the request's waiting sequences, reusing cached prefix blocks when enabled; the
        blocks parked for its sequences when it was preempted lose their priority (PrefixCache.unkeep)."""
        for seq in group.active_seqs():
            if seq.seq_id in self.block_tables:
                raise ValueError(f"sequence {seq.seq_id} already has a block table")
            table, holes = self._reuse_cached_prefix(seq, group.fork_pending_len)
            seq.num_computed_tokens = len(table) * self.block_size
            self._num_registered[seq.seq_id] = len(table)
            if holes:
                self._num_released[seq.seq_id] = holes
            needed = self.blocks_for(self._needed_len(seq))
            while len(table) < needed:
                table.append(self.device.allocate())
            self.block_tables[seq.seq_id] = table
        if self.prefix_cache is not None:
            for seq in group.seqs:
                self.prefix_cache.unkeep(seq.seq_id)

    def _reuse_cached_prefix(self, seq: Sequence, fork_at: Optional[int] = None) -> Tuple[List[int], int]:
        """The table of cached blocks the sequence starts with, and how many of its leading positions are holes
        (under a sliding window, a leader whose siblings fork from it at `fork_at` tokens skips no further:
        they share its blocks there, their windows included)."""
        if self.prefix_cache is None:
            return [], 0
        # At least one token is always computed, so that the step yields logits to sample from.
        num_full = (len(seq) - 1) // self.block_size
        hashes = self._block_hashes(seq, num_full)
        if self.sliding_window is not None:
            return self._reuse_cached_window(hashes if fork_at is None else hashes[:fork_at // self.block_size])
        table: List[int] = []
        for block_hash in hashes:
            block = self.prefix_cache.lookup(block_hash)
            if block is None:
                break
            self.device.incr(block)
            table.append(block)
        # Blocks after the first miss cannot hit (their hash chains through it): count them as misses.
        self.prefix_cache.num_queries += max(0, len(hashes) - len(table) - 1)
        self.num_cached_prefill_tokens += len(table) * self.block_size
        return table, 0

    def _reuse_cached_window(self, hashes: List[bytes]) -> Tuple[List[int], int]:
        """Under a sliding window a token reads only the blocks of its window: the sequence skips its longest
        prefix whose last window of blocks is cached, with holes behind that window (so one evicted block
        early in the chain does not make the later cached blocks unreachable). Every skipped block counts as
        a hit."""
        bs, cached = self.block_size, self.prefix_cache.hash_to_block
        skip = first = run = 0
        for i, block_hash in enumerate(hashes):
            run = run + 1 if block_hash in cached else 0
            start = max(0, (i + 1) * bs - self.sliding_window + 1) // bs  # first block the next token reads
            if run and i + 1 - run <= start:
                skip, first = i + 1, start
        table = [HOLE] * first
        for block_hash in hashes[first:skip]:
            block = cached[block_hash]
            self.device.incr(block)
            table.append(block)
        self.prefix_cache.num_queries += len(hashes)
        self.prefix_cache.num_hits += skip
        self.num_cached_prefill_tokens += skip * bs
        return table, first

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> List[bytes]:
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else seq.cache_salt, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    # ---- growth ------------------------------------------------------------------------------
    def _written_blocks(self, seq: Sequence, table: List[int]) -> Iterable[int]:
        """The blocks of `table` that the sequence's uncomputed tokens write into (never holes: those lie
        before the window of the first uncomputed token)."""
        first = seq.num_computed_tokens // self.block_size
        return table[first:min(len(table), self.blocks_for(seq.len_with_pending))]

    def _append_cost(self, seqs: Iterable[Sequence], tables: Dict[int, List[int]], holders) -> int:
        """New blocks plus copy-on-write copies that writing every uncomputed token of `seqs` takes.

        A block with `h` holders of which `w` write copies `min(w, h - 1)` times: each writer copies while
        somebody else still holds the block, and the last holder keeps the original."""
        writers: Dict[int, int] = {}
        new_blocks = 0
        for seq in seqs:
            table = tables[seq.seq_id]
            for block in self._written_blocks(seq, table):
                writers[block] = writers.get(block, 0) + 1
            new_blocks += max(0, self.blocks_for(self._needed_len(seq)) - len(table))
        return new_blocks + sum(max(0, min(w, holders(block) - 1)) for block, w in writers.items())

    def num_blocks_to_append(self, seqs: Iterable[Sequence]) -> int:
        """Free blocks that `append_slots` over these running sequences takes, exactly."""
        return self._append_cost(seqs, self.block_tables, self.device.ref_counts.__getitem__)

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence of the request can get slots for its uncomputed tokens."""
        return self.num_blocks_to_append(group.get_seqs(SequenceStatus.RUNNING)) <= self.get_num_free_blocks()

    def append_slots(self, seq: Sequence) -> List[Tuple[int, int]]:
        """Slots for every uncomputed token (under a sliding window, for the next one); returns the (source,
        destination) block copies that copy-on-write needs before the step writes into a block that other
        sequences still share."""
        table = self.block_tables[seq.seq_id]
        copies: List[Tuple[int, int]] = []
        first = seq.num_computed_tokens // self.block_size
        for i in range(first, min(len(table), self.blocks_for(seq.len_with_pending))):
            block = table[i]
            if self.device.ref_counts[block] > 1:
                new_block = self.device.allocate()
                self.device.free(block)
                table[i] = new_block
                copies.append((block, new_block))
        needed = self.blocks_for(self._needed_len(seq))
        while len(table) < needed:
            table.append(self.device.allocate())
        self.num_copy_on_write += len(copies)
        return copies

    def append_decode_slots(self, seqs: List[Sequence]) -> bool:
        """The common decode step at once: when every sequence has at most one token to compute, none of them
        writes into a shared block and the new blocks they need are free, give them those blocks and return True;
        otherwise change nothing and return False (the caller takes the general path, group by group, with its
        copy-on-write and preemption). One pass over the sequences, two integer checks each. A sequence with
        nothing to compute (its pending token is its last) counts its partly filled last block as written, as
        `append_slots` does."""
        bs, tables, counts = self.block_size, self.block_tables, self.device.ref_counts
        growing: List[List[int]] = []
        for seq in seqs:
            table = tables[seq.seq_id]
            computed = seq.num_computed_tokens
            if seq.len_with_pending == computed:
                if computed % bs and counts[table[computed // bs]] > 1:
                    return False
                continue
            index = computed // bs   # the block its one uncomputed token is written into
            if index >= len(table):
                if index > len(table):
                    return False
                growing.append(table)
            elif counts[table[index]] > 1:
                return False
        if len(growing) > self.get_num_free_blocks():
            return False
        for table, block in zip(growing, self.device.allocate_many(len(growing))):
            table.append(block)
        return True

    def release_slots_after(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks at the end of the sequence's table beyond those its first `num_tokens` tokens need:
        the blocks `append_slots` gave to draft tokens that were then rejected (speculative decoding). They were
        allocated for them alone and never entered the prefix cache (only known tokens name a block)."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        keep = max(self.blocks_for(num_tokens), self._num_registered.get(seq.seq_id, 0))
        while len(table) > keep:
            block = table.pop()
            if block != HOLE:
                self.device.free(block)

    def grow_for_chunk(self, seq: Sequence, num_tokens: int) -> int:
        """How many of the next `num_tokens` uncomputed tokens have slots, after giving a windowed sequence
        new blocks for them while any are free (the step's chunk; the blocks it leaves behind the window are
        released after the step). Without a window every uncomputed token already has its slot."""
        table = self.block_tables[seq.seq_id]
        start = seq.num_computed_tokens
        wanted = self.blocks_for(start + num_tokens)
        while len(table) < wanted and self.device.get_num_free_blocks():
            table.append(self.device.allocate())
        return min(num_tokens, len(table) * self.block_size - start)

    def mark_computed(self, seq: Sequence, upto: Optional[int] = None) -> List[Tuple[bytes, int]]:
        """Put the sequence's newly completed full blocks into the prefix cache (those within its first `upto`
        tokens, a step's chunk; default: every computed token); returns the (hash, block) pairs it added. Only
        known tokens are hashed: a token still being sampled never names a block. The engine registers a
        step's blocks when it launches the step (steps run in launch order, so a later step that finds them
        reads them computed) and drops them again if that step fails (`unregister`)."""
        if self.prefix_cache is None or seq.seq_id not in self.block_tables:
            return []
        num_full = min(seq.num_computed_tokens if upto is None else upto, len(seq.token_ids)) // self.block_size
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return []
        table = self.block_tables[seq.seq_id]
        hashes = self._block_hashes(seq, num_full)
        added = []
        for i in range(start, num_full):
            if table[i] != HOLE and self.prefix_cache.insert(hashes[i], table[i]):
                added.append((hashes[i], table[i]))
        self._num_registered[seq.seq_id] = num_full
        return added

    def unregister(self, entries: Iterable[Tuple[bytes, int]]) -> None:
        """Forget prefix-cache entries whose blocks were never computed (their step failed); a parked one goes
        back to the free list."""
        if self.prefix_cache is None:
            return
        for block_hash, block in entries:
            if self.prefix_cache.forget(block_hash, block):
                self.device.free_list.append(block)

    def release_out_of_window(self, seq: Sequence, upto: Optional[int] = None) -> None:
        """After a step: release the blocks no layer can read any more, those wholly before the window of
        the token after its first `upto` tokens (default: its next token to compute; a no-op unless every layer
        has a window)."""
        if self.sliding_window is None or seq.seq_id not in self.block_tables:
            return
        first_visible = (seq.num_computed_tokens if upto is None else upto) - self.sliding_window + 1
        limit = max(0, first_visible) // self.block_size
        table = self.block_tables[seq.seq_id]
        start = self._num_released.get(seq.seq_id, 0)
        for i in range(start, min(limit, len(table))):
            if table[i] != HOLE:
                self.device.free(table[i])
                table[i] = HOLE
        self._num_released[seq.seq_id] = max(start, min(limit, len(table)))

    # ---- sharing -----------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence, num_tokens: Optional[int] = None) -> None:
        """The child holds the parent's blocks (reference counts raised): all of them, or only those
        covering the first `num_tokens` tokens."""
        table = self.block_tables[parent.seq_id]
        if num_tokens is not None:
            table = table[:self.blocks_for(num_tokens)]
        for block in table:
            if block != HOLE:
                self.device.incr(block)
        self.block_tables[child.seq_id] = list(table)
        registered = self._num_registered.get(parent.seq_id, 0)
        released = self._num_released.get(parent.seq_id, 0)
        if num_tokens is not None:
            registered = min(registered, num_tokens // self.block_size)
            released = min(released, len(table))
        self._num_registered[child.seq_id] = registered
        self._num_released[child.seq_id] = released

    def free(self, seq: Sequence, will_recompute: bool = False) -> None:
        """Release a sequence's blocks (device or host); a no-op for a sequence without blocks.

        Tail first: cached blocks park in LRU order, so eviction takes a prefix chain from its end and
        the chain's head, which every later block's hash goes through, stays reachable longest. The blocks
        of a sequence preempted by recomputation (`will_recompute`) are parked for it, evicted after all
        others until it is readmitted or ends: it will find them in the cache when it comes back and
        recompute only what was lost."""
        self._num_registered.pop(seq.seq_id, None)
        self._num_released.pop(seq.seq_id, None)
        table = self.block_tables.pop(seq.seq_id, None)
        if table is not None:
            for block in reversed(table):
                if block != HOLE:
                    self.device.free(block, keep_for=seq.seq_id if will_recompute else None)
        table = self.swapped_tables.pop(seq.seq_id, None)
        if table is not None:
            for block in reversed(table):
                if block != HOLE:
                    self.host.free(block)

    def free_group(self, group: SequenceGroup) -> None:
        """Release every sequence of an ended request; blocks parked for them lose their priority."""
        for seq in group.seqs:
            self.free(seq)
            if self.prefix_cache is not None:
                self.prefix_cache.unkeep(seq.seq_id)

    # ---- swapping ----------------------------------------------------------------------------
    # A step's swaps go into one mapping per direction (device -> host out, host -> device in). A block
    # that two requests share is moved once: the second request finds it in the mapping and shares the
    # copy. This is sound because every block a request holds when it is swapped was written in an earlier
    # step: blocks freed by this step's swap-outs are only reallocated to requests that keep running.

    def can_swap_out(self, group: SequenceGroup, mapping: Dict[int, int]) -> bool:
        blocks = {b for s in group.get_seqs(SequenceStatus.RUNNING) for b in self.block_tables[s.seq_id]} - {HOLE}
        return len(blocks - mapping.keys()) <= self.get_num_free_swap_blocks()

    def swap_out(self, group: SequenceGroup, mapping: Dict[int, int]) -> None:
        """Move the running sequences' blocks to the host pool, adding device -> host pairs to `mapping`."""
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        self._move(seqs, self.block_tables, self.swapped_tables, self.device, self.host, mapping)
        for seq in seqs:
            self._num_registered.pop(seq.seq_id, None)

    def can_swap_in(self, group: SequenceGroup, mapping: Dict[int, int]) -> AllocStatus:
        """Whether the swapped sequences can come back and get slots for their next tokens: one device
        block per host block not already brought back this step, plus the exact growth after it."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        tables = {s.seq_id: self.swapped_tables[s.seq_id] for s in seqs}
        in_group: Dict[int, int] = {}
        for table in tables.values():
            for block in table:
                if block != HOLE:
                    in_group[block] = in_group.get(block, 0) + 1
        moved = sum(1 for block in in_group if block not in mapping)
        growth = self._append_cost(seqs, tables, lambda b: in_group[b] + (
            self.device.ref_counts[mapping[b]] if b in mapping else 0))
        growth_if_empty = self._append_cost(seqs, tables, lambda b: in_group[b])
        return self._status(moved + growth, len(in_group) + growth_if_empty)

    def swap_in(self, group: SequenceGroup, mapping: Dict[int, int]) -> None:
        """Bring swapped sequences back to the device pool, adding host -> device pairs to `mapping`."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        self._move(seqs, self.swapped_tables, self.block_tables, self.host, self.device, mapping)
        for seq in seqs:
            self._num_registered[seq.seq_id] = 0

    @staticmethod
    def _move(seqs: List[Sequence], src_tables: Dict[int, List[int]], dst_tables: Dict[int, List[int]],
              src: BlockAllocator, dst: BlockAllocator, mapping: Dict[int, int]) -> None:
        for seq in seqs:
            new_table = []
            for block in src_tables.pop(seq.seq_id):
                if block == HOLE:
                    new_table.append(HOLE)
                    continue
                if block in mapping:
                    dst.incr(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.free(block)
            dst_tables[seq.seq_id] = new_table

    # ---- statistics --------------------------------------------------------------------------
    def token_slot_usage(self, seqs: Iterable[Sequence]) -> Tuple[int, int]:
        """(slots holding a token, slots in the blocks these sequences hold), shared blocks once."""
        filled: Dict[int, int] = {}
        bs = self.block_size
        for seq in seqs:
            table = self.block_tables.get(seq.seq_id)
            if not table:
                continue
            for i, block in enumerate(table):
                if block == HOLE:
                    continue
                fill = min(bs, max(0, len(seq) - i * bs))
                if fill > filled.get(block, 0):
                    filled[block] = fill
                else:
                    filled.setdefault(block, fill)
        return sum(filled.values()), len(filled) * bs

    def num_held_blocks(self, seq: Sequence) -> int:
        """Device blocks the sequence holds (its table without the holes)."""
        return len(self.block_tables.get(seq.seq_id, ())) - self._num_released.get(seq.seq_id, 0)

    def kv_usage(self, seqs: Iterable[Sequence]) -> Tuple[int, int]:
        """`token_slot_usage` of every running sequence in O(sequences): the device blocks in use are exactly
        the running tables' blocks, all full but each table's last one (shared last blocks counted once)."""
        bs = self.block_size
        last_fill: Dict[int, int] = {}
        for seq in seqs:
            table = self.block_tables.get(seq.seq_id)
            if table:
                fill = min(bs, max(0, len(seq) - (len(table) - 1) * bs))
                last_fill[table[-1]] = max(fill, last_fill.get(table[-1], 0))
        slots = (self.num_blocks - self.get_num_free_blocks()) * bs
        return slots - sum(bs - fill for fill in last_fill.values()), slots
