"""The paged KV cache tensors: one `[num_blocks, block_size, num_kv_heads, head_size]` K and V per
layer on the model's device, a host copy of the same shape for swapped blocks, and block moves.

The cache holds the model's dtype or a compact one (`kv_cache_dtype`: bfloat16, float16, fp8 e4m3 / e5m2).
fp8 entries are `value / scale` with one K and one V scale per layer (`kv_scales`; 1.0 unless set, as in
vLLM without calibrated scales), saturated to the format's range; attention multiplies them back. Block moves
(swap, copy-on-write) copy the bytes, so they are exact for every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from paged_backend import kernels
from paged_backend.worker.huge_pages import huge_page_zeros


@dataclass(frozen=True)
class KVGeometry:
    """What one token costs in the cache."""

    num_layers: int
    num_kv_heads: int
    head_size: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * torch.empty((), dtype=dtype).element_size()

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)

    def shard(self, world_size: int) -> "KVGeometry":
        """The geometry of one tensor-parallel rank (its own KV heads; one replicated head when there are
        fewer KV heads than ranks)."""
        return KVGeometry(self.num_layers, max(1, self.num_kv_heads // world_size), self.head_size)


_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
              "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache entries for a CacheConfig.kv_cache_dtype name ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {tuple(_KV_DTYPES)}, got {kv_cache_dtype!r}")
    return _KV_DTYPES[kv_cache_dtype]


def _movable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or its bytes for fp8 (whose indexing copies PyTorch does not implement everywhere)."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor


def kv_geometry(config) -> KVGeometry:
    """Layers, KV heads and head size of a Hugging Face decoder config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVGeometry(config.num_hidden_layers, kv_heads, head_size)


class CacheEngine:
    """Owns the device KV cache and the host swap space; swaps and copies blocks in batches."""

    def __init__(self, geometry: KVGeometry, block_size: int, num_blocks: int, num_swap_blocks: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.geometry = geometry
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        shape = (geometry.num_layers, 2, num_blocks, block_size, geometry.num_kv_heads, geometry.head_size)
        if torch.device(device).type == "cpu":   # attention reads it every step: in huge pages (huge_pages.py)
            self.kv = huge_page_zeros(shape, dtype)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (geometry.num_layers, 2, num_swap_blocks) + shape[3:]
        pin = torch.device(device).type == "cuda"
        self.host_kv = torch.zeros(host_shape, dtype=dtype, device="cpu", pin_memory=pin)
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = [(self.kv[i, 0], self.kv[i, 1])
                                                                    for i in range(geometry.num_layers)]
        self.kv_scales: List[Tuple[float, float]] = [(1.0, 1.0)] * geometry.num_layers   # fp8: (K, V) per layer

    def release(self) -> None:
        """Drop the device and host KV tensors (the engine is shutting down); no block can be used afterwards."""
        self.kv = torch.empty(0, dtype=self.kv.dtype, device=self.kv.device)
        self.host_kv = torch.empty(0, dtype=self.host_kv.dtype)
        self.kv_caches = []

    def swap_out(self, mapping: Dict[int, int]) -> None:
        """Copy device blocks to host blocks (`mapping`: device -> host)."""
        if mapping:
            src, dst = self._index(mapping, self.kv.device)
            _movable(self.host_kv)[:, :, dst.cpu()] = _movable(self.kv)[:, :, src].to("cpu")

    def swap_in(self, mapping: Dict[int, int]) -> None:
        """Copy host blocks back to device blocks (`mapping`: host -> device)."""
        if mapping:
            src, dst = self._index(mapping, self.kv.device)
            _movable(self.kv)[:, :, dst] = _movable(self.host_kv)[:, :, src.cpu()].to(self.kv.device, non_blocking=True)

    def copy(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into destination blocks in every layer."""
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.long, device=self.kv.device)
            kernels.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    @staticmethod
    def _index(mapping: Dict[int, int], device) -> Tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor(list(mapping.keys()), dtype=torch.long, device=device)
        dst = torch.tensor(list(mapping.values()), dtype=torch.long, device=device)
        return src, dst
