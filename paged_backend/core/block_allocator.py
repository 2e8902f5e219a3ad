"""A pool of physical KV blocks: a free list and a reference count per block, O(1) allocate and free."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Deque, List, Optional

if TYPE_CHECKING:
    from paged_backend.core.prefix_cache import PrefixCache


class NoFreeBlocksError(RuntimeError):
    """The pool is exhausted; the scheduler checks capacity first, so reaching this is a bug."""


class BlockAllocator:
    """Hands out block numbers 0..num_blocks-1 and counts who holds each.

    With a prefix cache attached, a block whose count drops to zero but whose contents are cached is
    parked in the cache's LRU list instead of the free list; it still counts as free and is evicted
    (its cache entry dropped) only when the free list runs dry.
    """

    def __init__(self, num_blocks: int, name: str = "device", prefix_cache: Optional["PrefixCache"] = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts: List[int] = [0] * num_blocks
        self.free_list: Deque[int] = deque(range(num_blocks))
        self.prefix_cache = prefix_cache

    def allocate(self) -> int:
        """A block held once by the caller."""
        if self.free_list:
            block = self.free_list.popleft()
        elif self.prefix_cache is not None and self.prefix_cache.num_evictable:
            block = self.prefix_cache.evict()
        else:
            raise NoFreeBlocksError(f"no free {self.name} blocks (of {self.num_blocks})")
        self.ref_counts[block] = 1
        return block

    def allocate_many(self, count: int) -> List[int]:
        """`count` blocks, each held once, in the order `allocate` would give them (the caller checked that
        they are free)."""
        free = self.free_list
        if count <= len(free):
            blocks = [free.popleft() for _ in range(count)]
            counts = self.ref_counts
            for block in blocks:
                counts[block] = 1
            return blocks
        return [self.allocate() for _ in range(count)]

    def incr(self, block: int) -> None:
        """One more holder of a block; revives a cached block that had no holder."""
        if self.ref_counts[block] == 0:
            if self.prefix_cache is None or not self.prefix_cache.revive(block):
                raise ValueError(f"{self.name} block {block} is free and cannot be shared")
        self.ref_counts[block] += 1

    def free(self, block: int, keep_for: Optional[int] = None) -> None:
        """One holder fewer; the block returns to the pool when nobody holds it (a cached block stays in the
        prefix cache; parked for sequence `keep_for`, it is among the blocks evicted last until that sequence
        comes back or ends, see PrefixCache.park)."""
        count = self.ref_counts[block]
        if count <= 0:
            raise ValueError(f"double free of {self.name} block {block}")
        self.ref_counts[block] = count - 1
        if count == 1:
            if self.prefix_cache is None or not self.prefix_cache.park(block, keep_for):
                self.free_list.append(block)

    def get_num_free_blocks(self) -> int:
        evictable = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return len(self.free_list) + evictable
