"""Draws of plain sampled rows without waiting for the device (a GPU step's next forward is launched before its
tokens reach the host).

The semantics are `sample_rows`' (kernels/sampling.py): top-k with its ties, then top-p, then min-p keep a prefix
of each row's descending order, and a draw takes the kept token, in token-id order, at which the cumulative
probability first exceeds its uniform. `sample_rows_torch` shapes some of its tensors by values it reads from
the device (which rows failed, how wide a top-k is, whether a row's candidates hold its kept prefix); here every
such decision comes from the host's parameters, and a truncated row is sorted whole (its kept prefix and the
value at its end are then read from the sort: no bounded candidates, no fallback). The tokens are those of
`sample_rows_torch` up to the rounding of sums taken over another length.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .sampling import CHUNK_ELEMENTS, _draw, _kept_prefix, _row_maxima, check_rows

SORTED_ELEMENTS = CHUNK_ELEMENTS   # logits sorted at once (rows x vocab): float64 temporaries of 32 MiB each


def sample_rows_nosync(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       greedy: torch.Tensor, uniforms: torch.Tensor,
                       draw_offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N] int64, failed [R] bool) on the logits' device; the parameters, uniforms and offsets must be on
    the host (what the sampler builds). A failed row (no finite maximum) draws from zeros; its tokens are
    meaningless and `failed` marks it."""
    for name, tensor in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p), ("greedy", greedy),
                         ("uniforms", uniforms), ("draw_offsets", draw_offsets)):
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} must be on the host (its values decide shapes), it is on {tensor.device}")
    check_rows(logits, top_k, top_p, min_p, greedy, uniforms, draw_offsets)
    rows, vocab = logits.shape
    device = logits.device
    maxima, failed = _row_maxima(logits)
    logits = logits.masked_fill(failed[:, None], 0.0)
    maxima = maxima.masked_fill(failed, 0.0)
    top_k = torch.where((top_k <= 0) | (top_k > vocab) | greedy, torch.full_like(top_k, vocab), top_k)
    truncated = (~greedy & ((top_k < vocab) | (top_p < 1.0) | (min_p > 0.0))).nonzero().flatten()
    kept = torch.full((rows,), vocab, dtype=torch.long, device=device)
    boundary = None
    if truncated.numel():
        ends = []
        for chunk in truncated.split(max(1, SORTED_ELEMENTS // vocab)):   # a bounded transient per chunk
            index = chunk.to(device, non_blocking=True)
            values = logits[index].sort(dim=-1, descending=True).values
            kept[index], end = _kept_of_sorted(values, maxima[index], top_k[chunk].to(device, non_blocking=True),
                                               top_p[chunk].to(device, non_blocking=True),
                                               min_p[chunk].to(device, non_blocking=True))
            ends.append(end)
        boundary = torch.cat(ends)
    counts = draw_offsets[1:] - draw_offsets[:-1]
    row_of_draw = torch.repeat_interleave(torch.arange(rows), counts)
    tokens, _ = _draw(logits, maxima, kept, uniforms.to(device, torch.float64, non_blocking=True),
                      row_of_draw.to(device, non_blocking=True),
                      truncated=(truncated.to(device, non_blocking=True), boundary))
    greedy_draws = greedy[row_of_draw].nonzero().flatten()
    if greedy_draws.numel():
        draws = greedy_draws.to(device, non_blocking=True)
        tokens[draws] = logits.argmax(-1)[row_of_draw[greedy_draws].to(device, non_blocking=True)]
    return tokens, failed


def _kept_of_sorted(values: torch.Tensor, maxima: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Kept prefix lengths of rows sorted whole in descending order, and the value at each prefix's end. top-k
    keeps its ties: every value >= the k-th (the whole row when the k-th is -inf)."""
    vocab = values.shape[1]
    kth = values.gather(1, (top_k - 1).clamp(min=0)[:, None])
    top_k = torch.where(top_k < vocab, (values >= kth).sum(-1), top_k)
    e = (values.double() - maxima.double()[:, None]).exp()
    in_k = torch.arange(vocab, device=values.device)[None, :] < top_k[:, None]
    total = torch.where(in_k, e, torch.zeros_like(e)).sum(-1)
    kept = _kept_prefix(values, maxima, top_k, top_p, min_p, total)
    return kept, values.gather(1, (kept - 1).clamp(min=0)[:, None])
