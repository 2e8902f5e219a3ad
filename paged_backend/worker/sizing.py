"""How many KV blocks (device and host swap) a cache configuration gets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.worker.cache_engine import KVGeometry, kv_cache_torch_dtype
from paged_backend.config import CacheConfig

_GIB = 2**30


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    num_swap_blocks: int
    bytes_per_block: int  # per rank under tensor parallelism


def total_memory(device: torch.device) -> int:
    """All of the device's memory (CUDA), or MemTotal of the host (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * _GIB


def utilization_budget(util: float, device: torch.device, model_bytes: int) -> int:
    """KV cache bytes under vLLM's gpu_memory_utilization: `util` of the device's total memory, less the
    model's weights (already loaded); refused when the device has not that much memory free."""
    total, free = total_memory(device), available_memory(device)
    wanted = int(util * total)
    if wanted > free + model_bytes:
        raise ValueError(f"gpu_memory_utilization={util} asks for {wanted / _GIB:.2f} GiB of the {total / _GIB:.2f} GiB "
                         f"of {device}, but only {(free + model_bytes) / _GIB:.2f} GiB are free (with this model's "
                         f"weights); lower it")
    budget = wanted - model_bytes
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={util} ({wanted / _GIB:.2f} GiB of {device}) leaves no room for "
                         f"the KV cache after the model's weights ({model_bytes / _GIB:.2f} GiB); raise it")
    return budget


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
                  tensor_parallel_size: int = 1, model_bytes: int = 0) -> KVCacheSize:
    """Blocks from num_blocks, kv_cache_memory (bytes per rank), gpu_memory_utilization (a share of the
    device's memory, less the `model_bytes` of weights on it) or the default share of free memory. `dtype` is
    the model's; a block costs what `cache.kv_cache_dtype` stores (a compact dtype fits 2-4x the tokens)."""
    per_rank = geometry.shard(tensor_parallel_size) if tensor_parallel_size > 1 else geometry
    bytes_per_block = per_rank.bytes_per_block(cache.block_size, kv_cache_torch_dtype(cache.kv_cache_dtype, dtype))
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        if cache.gpu_memory_utilization is not None:
            budget = utilization_budget(cache.gpu_memory_utilization, torch.device(device), model_bytes)
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
