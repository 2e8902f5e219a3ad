"""Block tables: which physical KV blocks hold each sequence's tokens.

Blocks are allocated only when a token needs a slot, shared by reference count between forked
sequences and between requests with a cached common prefix, copied on the first write into a
shared block, and moved whole between the device pool and the host swap pool.
"""

from __future__ import annotations

import enum
from typing import Dict, Iterable, List, Tuple

from .block import BlockAllocator, PrefixCache, hash_block
from .sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    OK = "ok"        # admit now
    LATER = "later"  # wait for blocks to free up
    NEVER = "never"  # does not fit even in an empty cache: reject


class BlockManager:
    """Maps each sequence's logical blocks to physical blocks of the device or host pool."""

    def __init__(self, block_size: int, num_blocks: int, num_swap_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.device = BlockAllocator(num_blocks, "device", self.prefix_cache)
        self.host = BlockAllocator(num_swap_blocks, "host")
        self.block_tables: Dict[int, List[int]] = {}       # seq_id -> device blocks
        self.swapped_tables: Dict[int, List[int]] = {}     # seq_id -> host blocks
        self._num_registered: Dict[int, int] = {}          # seq_id -> leading blocks in the prefix cache
        self.num_cached_prefill_tokens = 0                 # prompt tokens whose prefill the cache skipped
        self.num_copy_on_write = 0

    # ---- sizes -----------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_num_free_blocks(self) -> int:
        return self.device.get_num_free_blocks()

    def get_num_free_swap_blocks(self) -> int:
        return self.host.get_num_free_blocks()

    # ---- admission ---------------------------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the waiting sequences of a request can get blocks for all their tokens."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        needed = sum(self.blocks_for(len(seq)) for seq in seqs) - sum(self._sibling_shares(seqs).values())
        if needed > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_blocks() - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Block tables for the waiting sequences, reusing cached prefix blocks when enabled.

        Sequences of one request that start with the same full blocks (the beams or samples of a
        preempted request being recomputed) share those blocks: the first computes them, the others
        wait for it through `prefix_owners` instead of recomputing them.
        """
        seqs = group.get_seqs(SequenceStatus.WAITING)
        shares = self._sibling_shares(seqs)
        owner_of: Dict[bytes, Tuple[int, Sequence]] = {}
        for seq in seqs:
            if seq.seq_id in self.block_tables:
                raise ValueError(f"sequence {seq.seq_id} already has a block table")
            table = self._reuse_cached_prefix(seq)
            seq.num_computed_tokens = len(table) * self.block_size
            self._num_registered[seq.seq_id] = len(table)
            seq.prefix_owners = []
            hashes = seq.block_hashes
            for i in range(len(table), shares.get(seq.seq_id, 0)):
                block, owner = owner_of[hashes[i]]
                self.device.incr(block)
                table.append(block)
                seq.prefix_owners.append((owner, (i + 1) * self.block_size))
            while len(table) < self.blocks_for(len(seq)):
                table.append(self.device.allocate())
            self.block_tables[seq.seq_id] = table
            for i in range(min(len(hashes), (len(seq) - 1) // self.block_size)):
                owner_of.setdefault(hashes[i], (table[i], seq))

    def _sibling_shares(self, seqs: List[Sequence]) -> Dict[int, int]:
        """seq_id -> leading full blocks identical to blocks of an earlier sequence in `seqs`."""
        shares: Dict[int, int] = {}
        if len(seqs) < 2:
            return shares
        seen = set()
        for seq in seqs:
            hashes = self._block_hashes(seq, (len(seq) - 1) // self.block_size)
            count = 0
            while count < len(hashes) and hashes[count] in seen:
                count += 1
            if count:
                shares[seq.seq_id] = count
            seen.update(hashes)
        return shares

    def _reuse_cached_prefix(self, seq: Sequence) -> List[int]:
        if self.prefix_cache is None:
            return []
        # At least one token is always computed, so that the step yields logits to sample from.
        num_full = (len(seq) - 1) // self.block_size
        hashes = self._block_hashes(seq, num_full)
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
        return table

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> List[bytes]:
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    # ---- growth ------------------------------------------------------------------------------
    def _writes(self, seq: Sequence) -> Tuple[int, int]:
        """(blocks shared by others that the step will write into, new blocks needed)."""
        table = self.block_tables[seq.seq_id]
        needed = self.blocks_for(len(seq))
        first = seq.num_computed_tokens // self.block_size
        shared = sum(1 for i in range(first, min(len(table), needed)) if self.device.ref_counts[table[i]] > 1)
        return shared, max(0, needed - len(table))

    def num_blocks_to_append(self, seqs: Iterable[Sequence]) -> int:
        return sum(sum(self._writes(seq)) for seq in seqs)

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence of the request can get slots for its uncomputed tokens."""
        return self.num_blocks_to_append(group.get_seqs(SequenceStatus.RUNNING)) <= self.get_num_free_blocks()

    def append_slots(self, seq: Sequence) -> List[Tuple[int, int]]:
        """Slots for every uncomputed token; returns the (source, destination) block copies that
        copy-on-write needs before the step writes into a block that other sequences still share."""
        table = self.block_tables[seq.seq_id]
        needed = self.blocks_for(len(seq))
        copies: List[Tuple[int, int]] = []
        for i in range(seq.num_computed_tokens // self.block_size, min(len(table), needed)):
            block = table[i]
            if self.device.ref_counts[block] > 1:
                new_block = self.device.allocate()
                self.device.free(block)
                table[i] = new_block
                copies.append((block, new_block))
        while len(table) < needed:
            table.append(self.device.allocate())
        self.num_copy_on_write += len(copies)
        return copies

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of a token position."""
        return self.block_tables[seq.seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def mark_computed(self, seq: Sequence) -> None:
        """After a step: put the sequence's newly completed full blocks into the prefix cache."""
        if self.prefix_cache is None or seq.seq_id not in self.block_tables:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        table = self.block_tables[seq.seq_id]
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            self.prefix_cache.insert(hashes[i], table[i])
        self._num_registered[seq.seq_id] = num_full

    # ---- sharing -----------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child holds the same blocks as the parent (reference counts raised)."""
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.device.incr(block)
        self.block_tables[child.seq_id] = list(table)
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (device or host); a no-op for a sequence without blocks."""
        self._num_registered.pop(seq.seq_id, None)
        table = self.block_tables.pop(seq.seq_id, None)
        if table is not None:
            for block in table:
                self.device.free(block)
        table = self.swapped_tables.pop(seq.seq_id, None)
        if table is not None:
            for block in table:
                self.host.free(block)

    def free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.free(seq)

    # ---- swapping ----------------------------------------------------------------------------
    def _unique_blocks(self, tables: Iterable[List[int]]) -> int:
        return len({block for table in tables for block in table})

    def can_swap_out(self, group: SequenceGroup) -> bool:
        tables = [self.block_tables[s.seq_id] for s in group.get_seqs(SequenceStatus.RUNNING)]
        return self._unique_blocks(tables) <= self.get_num_free_swap_blocks()

    def swap_out(self, group: SequenceGroup) -> Dict[int, int]:
        """Move the running sequences' blocks to the host pool; returns device -> host block numbers."""
        mapping = self._move(group, SequenceStatus.RUNNING, self.block_tables, self.swapped_tables,
                             self.device, self.host)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self._num_registered.pop(seq.seq_id, None)
        return mapping

    def can_swap_in(self, group: SequenceGroup) -> bool:
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        needed = self._unique_blocks(self.swapped_tables[s.seq_id] for s in seqs) + len(seqs)
        return self.get_num_free_blocks() - needed >= self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> Dict[int, int]:
        """Bring swapped sequences back to the device pool; returns host -> device block numbers."""
        mapping = self._move(group, SequenceStatus.SWAPPED, self.swapped_tables, self.block_tables,
                             self.host, self.device)
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            self._num_registered[seq.seq_id] = 0
        return mapping

    @staticmethod
    def _move(group: SequenceGroup, status: SequenceStatus, src_tables: Dict[int, List[int]],
              dst_tables: Dict[int, List[int]], src: BlockAllocator, dst: BlockAllocator) -> Dict[int, int]:
        mapping: Dict[int, int] = {}
        for seq in group.get_seqs(status):
            new_table = []
            for block in src_tables.pop(seq.seq_id):
                if block in mapping:
                    dst.incr(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.free(block)
            dst_tables[seq.seq_id] = new_table
        return mapping

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
                fill = min(bs, max(0, len(seq) - i * bs))
                if fill > filled.get(block, 0):
                    filled[block] = fill
                else:
                    filled.setdefault(block, fill)
        return sum(filled.values()), len(filled) * bs
