"""`paged-backend info`: what a model is, what its KV cache costs and which kernels run it."""

from __future__ import annotations

from typing import List

import torch

from paged_backend import kernels
from paged_backend.worker.cache_engine import kv_geometry
from paged_backend.config import parse_memory
from paged_backend.worker.loader import load_model
from paged_backend.worker.model_support import check_model_supported, describe_attention


def model_info(name: str, dtype: torch.dtype = torch.float32, block_size: int = 16,
               kv_cache_memory: str = "256MiB") -> str:
    """A short human-readable report, with each layer group's attention kind (full / window W / soft-cap /
    sinks) and the kernels in use; a model the engine cannot run exactly is reported as refused, with the
    reason."""
    model, _ = load_model(name, dtype=dtype)
    try:
        check_model_supported(model)
        attention = describe_attention(model)
    except ValueError as refusal:
        attention = [f"not supported: {refusal}"]
    geometry = kv_geometry(model.config)
    budget = parse_memory(kv_cache_memory, "kv_cache_memory")
    per_token = geometry.bytes_per_token(dtype)
    per_block = geometry.bytes_per_block(block_size, dtype)
    blocks = budget // per_block
    params = sum(p.numel() for p in model.parameters())
    config = model.config
    lines = [
        f"model:              {name}",
        f"architecture:       {type(model).__name__} ({config.model_type})",
        f"parameters:         {params:,} ({params / 1e6:.1f} M)",
        f"dtype:              {str(dtype).replace('torch.', '')}",
        f"layers / KV heads:  {geometry.num_layers} layers, {config.num_attention_heads} query heads, "
        f"{geometry.num_kv_heads} KV heads of size {geometry.head_size}",
        f"context:            {getattr(config, 'max_position_embeddings', None) or getattr(config, 'n_positions', '?')}"
        f" tokens",
        f"KV bytes per token: {per_token:,}",
        f"KV bytes per block: {per_block:,} ({block_size} tokens)",
        f"in {kv_cache_memory}:".ljust(20) + f"{blocks:,} blocks = {blocks * block_size:,} tokens",
    ]
    lines += [("attention:" if i == 0 else "").ljust(20) + line for i, line in enumerate(attention)]
    return "\n".join(lines + kernel_lines(next(model.parameters()).device))


def kernel_lines(device: torch.device) -> List[str]:
    """The kernels that run attention and sampling on `device`, and why a C++ kernel fell back to PyTorch."""
    in_use = kernels.kernels_in_use(device)
    lines = [f"kernels ({device.type}):".ljust(20) + f"attention {in_use['attention']}, sampler {in_use['sampler']}, "
                                                   f"compiled linear {in_use['linear_rows']}, "
                                                   f"compiled attention {in_use['attend_layer']}"]
    for name, reason in kernels.kernel_fallback_reasons().items():
        lines.append("".ljust(20) + f"{name} not built: {reason[:300]}")
    if device.type == "cpu":   # the instruction sets found at run time, and what the kernels use of them
        from paged_backend.kernels.cpu_features import describe_lines

        lines += [("cpu:" if i == 0 else "").ljust(20) + line for i, line in enumerate(describe_lines())]
        from paged_backend.worker.huge_pages import transparent_huge_pages, wanted

        lines.append("weights:".ljust(20) + ("in transparent huge pages" if wanted() else "in 4 KiB pages")
                     + f" (the kernel's policy: {transparent_huge_pages()})")
    return lines
