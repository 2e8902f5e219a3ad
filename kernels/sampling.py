"""Token draws from processed logits rows: greedy, or top-k / top-p / min-p truncation then inverse-CDF
sampling with given uniforms, without sorting the whole vocabulary.

Semantics (those of the engine's sampler, Hugging Face's order): on a row `x` (penalties and temperature
already applied) top-k keeps every logit >= the k-th largest (the ties with it too, as transformers'
`TopKLogitsWarper` and vLLM do); top-p then keeps, in descending order, each token whose
higher-ranked tokens hold less than `top_p` of the remaining probability; min-p then keeps the tokens with
`p >= min_p * p_max`. All three keep a prefix of the descending order, so a row's result is described by
`kept` (the prefix length) and `log_norm` (`max + log(sum of exp(x - max) over the kept tokens)`): a kept
token's log-probability is `x - log_norm`. A draw with uniform `u` takes the kept token, in token-id order,
at which the cumulative probability first exceeds `u` (float64 accumulation); a token of probability 0 (a
masked, -inf logit) is never drawn, whatever rounding does near u = 1 or a block's end. Greedy rows take the
first maximum and keep the whole row (their log-probabilities are those of the full softmax).

`sample_rows` runs the compiled CPU kernel (kernels/cpu_sampler.cpp) on CPU tensors when it builds, and
`sample_rows_torch` otherwise (CUDA tensors, or no compiler): the torch version takes the candidates from
one `topk` of bounded size and falls back to a full sort only for rows whose kept prefix reaches past it.
`sampling_device.sample_rows_nosync` draws the same way without reading anything back (a GPU step's path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

CANDIDATES = 1024        # candidates per top-p / min-p row before the exact fallback (torch version)
CDF_BLOCK = 1024         # tokens per block of the two-level CDF of untruncated rows (torch version)
CHUNK_ELEMENTS = 1 << 22  # logits per chunk of rows in the passes whose temporaries are 8 bytes a logit


@dataclass
class RowDraws:
    """Per draw: the token and its log-probability; per row: the kept prefix and its log-normaliser."""

    tokens: torch.Tensor      # [N] int64
    logprobs: torch.Tensor    # [N] float64
    kept: torch.Tensor        # [R] int64
    log_norm: torch.Tensor    # [R] float64
    failed_rows: List[int] = field(default_factory=list)  # rows without a finite maximum (allow_failed_rows)


def no_finite_maximum(row: int) -> ValueError:
    return ValueError(f"logits row {row} has no finite maximum (all -inf, +inf or NaN): nothing to sample")


def check_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
               greedy: torch.Tensor, uniforms: torch.Tensor, draw_offsets: torch.Tensor) -> None:
    """ValueError for inputs no implementation can use."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a float32 [rows, vocab] tensor, got {tuple(logits.shape)} {logits.dtype}")
    rows = logits.shape[0]
    for name, tensor in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p), ("greedy", greedy)):
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must have one entry per row ({rows}), got {tuple(tensor.shape)}")
    if draw_offsets.shape != (rows + 1,) or uniforms.dim() != 1:
        raise ValueError("draw_offsets must be [rows + 1] and uniforms 1-D")
    if rows and int(draw_offsets[-1]) != uniforms.shape[0]:
        raise ValueError(f"draw_offsets ends at {int(draw_offsets[-1])}, there are {uniforms.shape[0]} uniforms")


def _row_maxima(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row maxima, and which rows have no finite maximum (all -inf, a +inf or a NaN)."""
    maxima = logits.amax(-1) if logits.shape[1] else logits.new_full((logits.shape[0],), float("-inf"))
    return maxima, ~torch.isfinite(maxima) | logits.isnan().any(-1)


def _kept_prefix(values: torch.Tensor, maxima: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Kept prefix lengths of rows whose logits, sorted in descending order, start with `values` [R, C];
    `total` is each row's sum of exp(x - max) over its top-k set (the whole row without top-k)."""
    e = (values.double() - maxima.double()[:, None]).exp()
    in_k = torch.arange(values.shape[1], device=values.device)[None, :] < top_k[:, None]
    e_k = torch.where(in_k, e, torch.zeros_like(e))
    before = e_k.cumsum(-1) - e_k
    keep = in_k & ((before < top_p.double()[:, None] * total[:, None]) | (top_p[:, None] >= 1.0))
    keep &= e >= min_p.double()[:, None]
    return keep.long().cumprod(-1).sum(-1)


def kept_prefixes(logits: torch.Tensor, maxima: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Kept prefix lengths of the truncated `rows`: candidates from one bounded `topk` (a row's top-k set, or
    CANDIDATES tokens for top-p / min-p alone), then a full sort only for rows whose prefix fills it."""
    vocab = logits.shape[1]
    kept = torch.empty(rows.shape[0], dtype=torch.long, device=logits.device)
    bound = torch.where(top_k[rows] < vocab, top_k[rows], torch.full_like(rows, CANDIDATES)).clamp(max=vocab)
    todo = torch.arange(rows.shape[0], device=logits.device)
    while todo.numel():
        index = rows[todo]
        width = int(bound[todo].max())
        values = logits[index].topk(width, dim=-1).values
        e = (values.double() - maxima[index].double()[:, None]).exp()
        in_k = torch.arange(width, device=logits.device)[None, :] < top_k[index][:, None]
        whole = top_k[index] <= width                  # the top-k set (or the whole row) is inside the candidates
        full_sums = (logits[index].double() - maxima[index].double()[:, None]).exp().sum(-1)
        total = torch.where(whole, torch.where(in_k, e, torch.zeros_like(e)).sum(-1), full_sums)
        prefix = _kept_prefix(values, maxima[index], top_k[index], top_p[index], min_p[index], total)
        done = whole | (prefix < width)
        kept[todo[done]] = prefix[done]
        todo = todo[~done]
        bound[todo] = vocab                            # the exact fallback: the whole row, sorted
    return kept


def sample_rows_torch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                      greedy: torch.Tensor, uniforms: torch.Tensor, draw_offsets: torch.Tensor,
                      allow_failed_rows: bool = False) -> RowDraws:
    """The PyTorch implementation (any device). `top_k` <= 0 or >= vocab means no top-k."""
    check_rows(logits, top_k, top_p, min_p, greedy, uniforms, draw_offsets)
    rows, vocab = logits.shape
    device = logits.device
    top_k, top_p, min_p, greedy = top_k.to(device), top_p.to(device), min_p.to(device), greedy.to(device)
    uniforms, draw_offsets = uniforms.to(device, torch.float64), draw_offsets.to(device)
    maxima, bad = _row_maxima(logits)
    failed_rows: List[int] = []
    if bool(bad.any()):
        failed_rows = bad.nonzero().flatten().tolist()
        if not allow_failed_rows:
            raise no_finite_maximum(failed_rows[0])
        logits = logits.masked_fill(bad[:, None], 0.0)   # a copy: the failed rows are drawn from, then ignored
        maxima = maxima.masked_fill(bad, 0.0)
    top_k = torch.where((top_k <= 0) | (top_k > vocab) | greedy, torch.full_like(top_k, vocab), top_k)
    top_k = with_ties(logits, top_k)
    truncated = ~greedy & ((top_k < vocab) | (top_p < 1.0) | (min_p > 0.0))
    kept = torch.full((rows,), vocab, dtype=torch.long, device=device)
    index = truncated.nonzero().flatten()
    if index.numel():
        kept[index] = kept_prefixes(logits, maxima, top_k, top_p, min_p, index)
    counts = draw_offsets[1:] - draw_offsets[:-1]
    row_of_draw = torch.repeat_interleave(torch.arange(rows, device=device), counts)
    tokens, log_norm = _draw(logits, maxima, kept, uniforms, row_of_draw)
    greedy_draws = greedy[row_of_draw]
    if bool(greedy_draws.any()):
        tokens[greedy_draws] = logits.argmax(-1)[row_of_draw[greedy_draws]]
    logprobs = logits[row_of_draw, tokens].double() - log_norm[row_of_draw]
    return RowDraws(tokens, logprobs, kept, log_norm, failed_rows)


def with_ties(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's top-k widened to every logit >= its k-th largest (transformers' TopKLogitsWarper and vLLM keep
    the ties): the count of such logits, the whole row when the k-th value is -inf."""
    vocab = logits.shape[1]
    rows = (top_k < vocab).nonzero().flatten()
    if not rows.numel():
        return top_k
    width = int(top_k[rows].max())
    kth = logits[rows].topk(width, dim=-1).values.gather(1, (top_k[rows] - 1)[:, None])
    widened = top_k.clone()
    widened[rows] = (logits[rows] >= kth).sum(-1)
    return widened


def kept_mask(logits: torch.Tensor, kept: torch.Tensor, boundary: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[R, V] True on each row's kept prefix: the logits above the kept-th largest (`boundary` [R, 1] when the
    caller knows it), then the tokens equal to it in increasing id order (ties broken as the C++ kernel does)."""
    vocab = logits.shape[1]
    if boundary is None:
        width = int(kept.max())
        boundary = logits.topk(width, dim=-1).values.gather(1, (kept - 1).clamp(min=0)[:, None])
    above = logits > boundary
    tied = logits == boundary
    room = kept[:, None] - above.sum(-1, keepdim=True)
    mask = above | (tied & (tied.long().cumsum(-1) <= room))
    return mask | (kept >= vocab)[:, None]


def _draw(logits: torch.Tensor, maxima: torch.Tensor, kept: torch.Tensor, uniforms: torch.Tensor,
          row_of_draw: torch.Tensor, truncated: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None):
    """Tokens of every draw and each row's log-normaliser, by a two-level inverse CDF over the kept tokens
    in token-id order: float64 sums of CDF_BLOCK-token blocks, then a cumulative sum inside the chosen
    block, so no float64 copy of the whole vocabulary is made. `truncated`: (the rows that may keep less than
    the whole row, the value at each one's kept prefix's end) when the caller knows them (nothing read back)."""
    rows, vocab = logits.shape
    blocks = -(-vocab // CDF_BLOCK)
    e = torch.zeros(rows, blocks * CDF_BLOCK, dtype=torch.float32, device=logits.device)
    e[:, :vocab] = (logits - maxima[:, None]).exp()
    if truncated is None:
        index, boundary = (kept < vocab).nonzero().flatten(), None
    else:
        index, boundary = truncated
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))   # rows per chunk: a bounded transient on a GPU
    for start in range(0, index.shape[0], step):
        part = index[start:start + step]
        e[part, :vocab] *= kept_mask(logits[part], kept[part], None if boundary is None else
                                     boundary[start:start + step])
    e = e.view(rows, blocks, CDF_BLOCK)
    block_mass = torch.cat([chunk.sum(-1, dtype=torch.float64) for chunk in e.split(step)]) if rows else \
        e.sum(-1, dtype=torch.float64)
    block_cdf = block_mass.cumsum(-1)
    total = block_cdf[:, -1]
    last_block = blocks - 1 - (block_mass.flip(-1) > 0).int().argmax(-1)   # the last block holding a kept token
    tokens = torch.zeros(uniforms.shape[0], dtype=torch.long, device=logits.device)
    if uniforms.numel():
        target = uniforms * total[row_of_draw]
        block = torch.searchsorted(block_cdf[row_of_draw], target[:, None], right=True)[:, 0]
        block = torch.minimum(block, last_block[row_of_draw])
        before = torch.where(block > 0, block_cdf[row_of_draw, (block - 1).clamp(min=0)], torch.zeros_like(target))
        inner = e[row_of_draw, block].double().cumsum(-1)
        offset = torch.searchsorted(inner, (target - before)[:, None], right=True)[:, 0]
        # past the block's last kept token (rounding): step back to it
        offset = torch.minimum(offset, (inner < inner[:, -1:]).sum(-1))
        tokens = (block * CDF_BLOCK + offset).clamp(max=vocab - 1)
    return tokens, maxima.double() + total.log()


def sample_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                greedy: torch.Tensor, uniforms: torch.Tensor, draw_offsets: torch.Tensor,
                allow_failed_rows: bool = False) -> RowDraws:
    """Draws for every row: the compiled kernel for CPU logits when it builds (PAGED_BACKEND_KERNELS=torch
    forces the PyTorch version), the PyTorch version otherwise. A row without a finite maximum is a
    ValueError naming it, or with `allow_failed_rows` is listed in `failed_rows` (its draws are meaningless)
    while the other rows are drawn exactly as without it."""
    from . import cpu_sampling, kernel_backend

    if logits.device.type == "cpu" and kernel_backend(logits) == "cpp" and cpu_sampling.available():
        return cpu_sampling.sample_rows(logits, top_k, top_p, min_p, greedy, uniforms, draw_offsets, allow_failed_rows)
    return sample_rows_torch(logits, top_k, top_p, min_p, greedy, uniforms, draw_offsets, allow_failed_rows)


@dataclass
class GreedyDraws:
    """Per row: its first maximum (-1 for a row without a finite maximum) and its log-normaliser (NaN when not
    asked for, or for such a row)."""

    tokens: torch.Tensor      # [R] int64, on the host (what the engine reads next)
    log_norm: torch.Tensor    # [R] float64, on the logits' device
    failed_rows: List[int] = field(default_factory=list)


def greedy_rows(logits: torch.Tensor, with_norms: bool = True) -> GreedyDraws:
    """Greedy rows alone, as `sample_rows` draws them: each row's first maximum and, with `with_norms`, its
    log-normaliser (a token's log-probability is `x - log_norm`); without, only the maximum and its place, one
    pass over the row. The compiled kernel for CPU logits when it builds, PyTorch otherwise."""
    from . import cpu_sampling, kernel_backend

    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a float32 [rows, vocab] tensor, got {tuple(logits.shape)} {logits.dtype}")
    if logits.device.type == "cpu" and kernel_backend(logits) == "cpp" and cpu_sampling.available():
        return cpu_sampling.greedy_rows(logits, with_norms)
    return greedy_rows_torch(logits, with_norms)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, -1 for a row without a finite maximum, on the logits' device: no wait for the
    device (a GPU step's next inputs are filled from them there, while their copy to the host is on its way)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a float32 [rows, vocab] tensor, got {tuple(logits.shape)} {logits.dtype}")
    _, bad = _row_maxima(logits)
    return _first_maxima(logits).masked_fill(bad, -1)


def _first_maxima(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1) if logits.shape[1] else torch.zeros(logits.shape[0], dtype=torch.long,
                                                                 device=logits.device)


def greedy_rows_torch(logits: torch.Tensor, with_norms: bool = True) -> GreedyDraws:
    """The PyTorch version of `greedy_rows` (any device)."""
    maxima, bad = _row_maxima(logits)
    tokens = _first_maxima(logits)
    log_norm = torch.full((logits.shape[0],), float("nan"), dtype=torch.float64, device=logits.device)
    if with_norms:
        safe = maxima.masked_fill(bad, 0.0)
        log_norm = safe.double() + (logits - safe[:, None]).exp().sum(-1, dtype=torch.float64).log()
        log_norm = log_norm.masked_fill(bad, float("nan"))
    tokens = tokens.masked_fill(bad, -1).cpu()   # one wait for the device; the failed rows are read on the host
    return GreedyDraws(tokens, log_norm, (tokens < 0).nonzero().flatten().tolist())
