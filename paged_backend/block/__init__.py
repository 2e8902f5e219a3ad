"""Physical KV block pools and the prefix cache (pure Python, no torch)."""

from .allocator import BlockAllocator, NoFreeBlocksError
from .prefix_cache import PrefixCache, hash_block

__all__ = ["BlockAllocator", "NoFreeBlocksError", "PrefixCache", "hash_block"]
