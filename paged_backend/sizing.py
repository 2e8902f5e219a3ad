"""How many KV blocks (device and host swap) a cache configuration gets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_engine import KVGeometry, kv_cache_torch_dtype
from .config import CacheConfig

_GIB = 2**30


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    num_swap_blocks: int
    bytes_per_block: int  # per rank under tensor parallelism


def available_memory(device: torch.device) -> int:
    """Free bytes on the device (CUDA) or MemAvailable of the host (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * _GIB


def default_kv_cache_bytes(device: torch.device) -> int:
    """A sane share of free memory: 80% of a GPU's free memory, a quarter of the host's (at most 4 GiB)."""
    free = available_memory(device)
    if device.type == "cuda":
        return int(free * 0.8)
    return min(free // 4, 4 * _GIB)


def size_kv_cache(cache: CacheConfig, geometry: KVGeometry, dtype: torch.dtype, device: torch.device,
                  tensor_parallel_size: int = 1) -> KVCacheSize:
    """Blocks from num_blocks, kv_cache_memory (bytes per rank) or the default share of free memory. `dtype` is
    the model's; a block costs what `cache.kv_cache_dtype` stores (a compact dtype fits 2-4x the tokens)."""
    per_rank = geometry.shard(tensor_parallel_size) if tensor_parallel_size > 1 else geometry
    bytes_per_block = per_rank.bytes_per_block(cache.block_size, kv_cache_torch_dtype(cache.kv_cache_dtype, dtype))
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        budget = cache.kv_cache_memory or default_kv_cache_bytes(torch.device(device))
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no block: one block of "
                             f"{cache.block_size} tokens takes {bytes_per_block} bytes")
    if cache.num_swap_blocks is not None:
        num_swap_blocks = cache.num_swap_blocks
    elif cache.swap_space is not None:
        num_swap_blocks = int(cache.swap_space) // bytes_per_block
    else:
        num_swap_blocks = min(num_blocks, max(1, _GIB // bytes_per_block))
    return KVCacheSize(num_blocks, num_swap_blocks, bytes_per_block)
