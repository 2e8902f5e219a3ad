"""Content-addressed full blocks for sharing common prompt prefixes across requests.

A full block is named by a SHA-256 chained over the previous block's hash and its own token ids,
so a block is only ever reused for the very same tokens after the very same prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Dict, Optional, Sequence


def hash_block(prev_hash: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent's hash and this block's token ids."""
    digest = hashlib.sha256(prev_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class PrefixCache:
    """hash -> physical block for computed full blocks, with LRU lists of blocks nobody holds.

    Blocks of a request preempted by recomputation are parked in a second list that is evicted only
    after the first is empty: that request will come back for them, so they are the most useful."""

    def __init__(self) -> None:
        self.hash_to_block: Dict[bytes, int] = {}
        self.block_to_hash: Dict[int, bytes] = {}
        self.evictable: "OrderedDict[int, None]" = OrderedDict()
        self.evictable_kept: "OrderedDict[int, None]" = OrderedDict()  # of preempted requests: evicted last
        self.num_queries = 0
        self.num_hits = 0
        self.num_evictions = 0

    @property
    def num_evictable(self) -> int:
        return len(self.evictable) + len(self.evictable_kept)

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

    def park(self, block: int, keep: bool = False) -> bool:
        """A cached block lost its last holder: keep it (most recently used last) instead of freeing it;
        `keep` parks it among the blocks evicted last."""
        if block not in self.block_to_hash:
            return False
        (self.evictable_kept if keep else self.evictable)[block] = None
        return True

    def revive(self, block: int) -> bool:
        """A parked block gets a holder again."""
        for parked in (self.evictable, self.evictable_kept):
            if block in parked:
                del parked[block]
                return True
        return False

    def evict(self) -> int:
        """Drop the least recently used parked block from the cache (preempted requests' blocks last)."""
        block, _ = (self.evictable or self.evictable_kept).popitem(last=False)
        del self.hash_to_block[self.block_to_hash.pop(block)]
        self.num_evictions += 1
        return block

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
