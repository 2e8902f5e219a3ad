"""Content-addressed full blocks for sharing common prompt prefixes across requests.

A full block is named by a SHA-256 chained over the previous block's hash and its own token ids,
so a block is only ever reused for the very same tokens after the very same prefix.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple


def hash_block(prev_hash: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent's hash and this block's token ids."""
    digest = hashlib.sha256(prev_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class PrefixCache:
    """hash -> physical block for computed full blocks; blocks nobody holds stay parked, and are evicted least
    recently parked first.

    The blocks a sequence preempted by recomputation leaves behind are parked *for* it (`park(block, owner)`):
    they are evicted only after every other parked block, since it will come back for them. That priority
    ends when the owner is readmitted or its request ends (`unkeep(owner)`): its blocks still parked then
    take their place in the ordinary order again, by the time they were parked."""

    def __init__(self) -> None:
        self.hash_to_block: Dict[bytes, int] = {}
        self.block_to_hash: Dict[int, bytes] = {}
        self.evictable: "OrderedDict[int, int]" = OrderedDict()  # block -> park time, in park order
        self.evictable_kept: "OrderedDict[int, Tuple[int, int]]" = OrderedDict()  # block -> (owner, park time)
        self._owned: Dict[int, List[int]] = {}                   # owner -> blocks parked for it
        # Blocks whose owner gave them up: ordinary again, but parked earlier than some of `evictable`, so they
        # wait in a heap by park time (entries of blocks revived since are stale and skipped).
        self._returned: Dict[int, int] = {}                      # block -> park time
        self._returned_heap: List[Tuple[int, int]] = []          # (park time, block)
        self._clock = itertools.count()
        self.num_queries = 0
        self.num_hits = 0
        self.num_evictions = 0

    @property
    def num_evictable(self) -> int:
        return len(self.evictable) + len(self.evictable_kept) + len(self._returned)

    def parked_blocks(self) -> List[int]:
        """Every block nobody holds that the cache keeps (they all count as free)."""
        return list(self.evictable) + list(self.evictable_kept) + list(self._returned)

    def lookup(self, block_hash: bytes) -> Optional[int]:
        """The cached block for a hash, counting the query for the hit rate."""
        self.num_queries += 1
        block = self.hash_to_block.get(block_hash)
        if block is not None:
            self.num_hits += 1
        return block

    def insert(self, block_hash: bytes, block: int) -> bool:
        """Remember a freshly computed full block; False if the hash or the block is already known."""
        if block_hash in self.hash_to_block or block in self.block_to_hash:
            return False
        self.hash_to_block[block_hash] = block
        self.block_to_hash[block] = block_hash
        return True

    def park(self, block: int, owner: Optional[int] = None) -> bool:
        """A cached block lost its last holder: keep it (most recently parked last) instead of freeing it; with
        an `owner` (a sequence preempted by recomputation) it is evicted only after every other parked block."""
        if block not in self.block_to_hash:
            return False
        now = next(self._clock)
        if owner is None:
            self.evictable[block] = now
        else:
            self.evictable_kept[block] = (owner, now)
            self._owned.setdefault(owner, []).append(block)
        return True

    def unkeep(self, owner: int) -> None:
        """The owner is readmitted or gone: the blocks still parked for it lose their priority."""
        for block in self._owned.pop(owner, ()):
            entry = self.evictable_kept.get(block)
            if entry is None or entry[0] != owner:
                continue  # revived (or parked again for another owner) since
            del self.evictable_kept[block]
            self._returned[block] = entry[1]
            heapq.heappush(self._returned_heap, (entry[1], block))

    def forget(self, block_hash: bytes, block: int) -> bool:
        """Drop a registration whose block will not hold what the hash names (the step computing it failed);
        True when the block was parked (nobody holds it), so that the caller returns it to the free list."""
        if self.hash_to_block.get(block_hash) != block:
            return False
        del self.hash_to_block[block_hash]
        del self.block_to_hash[block]
        return (self.evictable.pop(block, None) is not None or self._returned.pop(block, None) is not None
                or self.evictable_kept.pop(block, None) is not None)

    def revive(self, block: int) -> bool:
        """A parked block gets a holder again."""
        if self.evictable.pop(block, None) is not None or self._returned.pop(block, None) is not None:
            return True
        return self.evictable_kept.pop(block, None) is not None

    def evict(self) -> int:
        """Drop the least recently parked block from the cache (blocks parked for an owner last)."""
        returned = self._oldest_returned()
        if returned is not None and (not self.evictable or returned[0] < next(iter(self.evictable.values()))):
            heapq.heappop(self._returned_heap)
            block = returned[1]
            del self._returned[block]
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
        else:
            block, _ = self.evictable_kept.popitem(last=False)
        del self.hash_to_block[self.block_to_hash.pop(block)]
        self.num_evictions += 1
        return block

    def _oldest_returned(self) -> Optional[Tuple[int, int]]:
        """The heap's oldest live entry (stale entries dropped on the way), or None."""
        heap = self._returned_heap
        while heap and self._returned.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._returned) + 64:  # many stale entries below the top: rebuild
            heap[:] = [(stamp, block) for block, stamp in self._returned.items()]
            heapq.heapify(heap)
        return heap[0] if heap else None

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
