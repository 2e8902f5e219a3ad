"""Token draws for CPU logits through the compiled kernel (`cpu_sampler.cpp`); same contract as
`sampling.sample_rows_torch`."""

from __future__ import annotations

import torch

from .cpu_build import build_error, load_library
from .sampling import GreedyDraws, RowDraws, check_rows, no_finite_maximum


def available() -> bool:
    return load_library("cpu_sampler") is not None


def sample_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                greedy: torch.Tensor, uniforms: torch.Tensor, draw_offsets: torch.Tensor,
                allow_failed_rows: bool = False) -> RowDraws:
    """See kernels/sampling.py; ValueError naming the first row with no finite maximum (unless
    `allow_failed_rows`: then such rows are listed in `failed_rows`, the kernel having skipped them)."""
    library = load_library("cpu_sampler")
    if library is None:
        raise RuntimeError(f"the CPU sampling kernel is not available: {build_error('cpu_sampler')}")
    check_rows(logits, top_k, top_p, min_p, greedy, uniforms, draw_offsets)
    if logits.device.type != "cpu":
        raise ValueError(f"logits are on {logits.device}; the compiled sampler runs on CPU tensors")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    top_k = top_k.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float64).contiguous()
    min_p = min_p.to(torch.float64).contiguous()
    greedy = greedy.to(torch.uint8).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    draw_offsets = draw_offsets.to(torch.int64).contiguous()
    tokens = torch.empty(uniforms.shape[0], dtype=torch.int64)
    logprobs = torch.empty(uniforms.shape[0], dtype=torch.float64)
    kept = torch.empty(rows, dtype=torch.int64)
    log_norm = torch.empty(rows, dtype=torch.float64)
    if rows:
        status = library.sample_rows(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], top_k.data_ptr(),
                                     top_p.data_ptr(), min_p.data_ptr(), greedy.data_ptr(), uniforms.data_ptr(),
                                     draw_offsets.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), kept.data_ptr(),
                                     log_norm.data_ptr(), torch.get_num_threads())
        if status and not allow_failed_rows:
            raise no_finite_maximum(status - 1)
        if status:   # the kernel marks each failed row with kept = 0 (a row that samples keeps at least one token)
            return RowDraws(tokens, logprobs, kept, log_norm, (kept == 0).nonzero().flatten().tolist())
    return RowDraws(tokens, logprobs, kept, log_norm)


def greedy_rows(logits: torch.Tensor, with_norms: bool = True) -> GreedyDraws:
    """See kernels/sampling.py (`greedy_rows`)."""
    library = load_library("cpu_sampler")
    if library is None:
        raise RuntimeError(f"the CPU sampling kernel is not available: {build_error('cpu_sampler')}")
    if logits.device.type != "cpu":
        raise ValueError(f"logits are on {logits.device}; the compiled sampler runs on CPU tensors")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    log_norm = torch.empty(rows, dtype=torch.float64)
    if rows:
        status = library.greedy_rows(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], int(with_norms),
                                     tokens.data_ptr(), log_norm.data_ptr(), torch.get_num_threads())
        if status:
            return GreedyDraws(tokens, log_norm, (tokens < 0).nonzero().flatten().tolist())
    return GreedyDraws(tokens, log_norm)
