"""The speculative-sampling rule (Leviathan et al., Chen et al.) for drafts drawn from a distribution q.

Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), where p_i is the target's distribution at its
position exactly as the sampler draws from it (temperature, top-k, top-p, min-p); at the first rejection the
token comes from max(0, p_i - q_i), normalised; after k accepted drafts the next token comes from p_k. The
output then follows the target distribution whatever q is. (Drafts that are a point mass, prompt lookup or a
greedy draft model, need none of this: see verifier.py.)
"""

from __future__ import annotations

from typing import List, Optional, Sequence as Seq

import torch

from paged_backend import kernels
from paged_backend.kernels.sampling import kept_mask
from paged_backend.sampling.sampler import SampleRequest, apply_temperature, truncation_params


def target_distributions(logits: torch.Tensor, requests: Seq[SampleRequest]) -> torch.Tensor:
    """Each row's distribution as the sampler draws from it ([R, V] float64): temperature, then the kept tokens
    of top-k / top-p / min-p (the sampler's own truncation), normalised. Rows must need no processing."""
    scores = apply_temperature(logits.to(torch.float32).clone(), list(requests))
    offsets = torch.arange(len(requests) + 1, dtype=torch.long)
    draws = kernels.sample_rows(scores, *truncation_params(list(requests)),
                                torch.zeros(len(requests), dtype=torch.float64), offsets)
    probs = (scores.double() - draws.log_norm.to(scores.device)[:, None]).exp()
    truncated = draws.kept < scores.shape[1]
    if bool(truncated.any()):
        rows = truncated.nonzero().flatten()
        probs[rows] *= kept_mask(scores[rows], draws.kept[rows].to(scores.device))
    return probs


def speculative_sample(p: torch.Tensor, q: torch.Tensor, drafts: Seq[int],
                       generator: Optional[torch.Generator] = None) -> List[int]:
    """The accepted drafts followed by one token from the target: `p` [k + 1, V] the target's distributions at
    the k drafts' positions and after them, `q` [k, V] the distributions the drafts were drawn from."""
    out: List[int] = []
    for i, draft in enumerate(drafts):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(q[i, draft]) < float(p[i, draft]):   # u < p / q, without dividing by q
            out.append(int(draft))
            continue
        residual = (p[i] - q[i].to(p.dtype)).clamp(min=0)
        total = float(residual.sum())
        row = residual / total if total > 0 else p[i]
        out.append(int(torch.multinomial(row.cpu(), 1, generator=generator)))   # the generators are the host's
        return out
    out.append(int(torch.multinomial(p[len(drafts)].cpu(), 1, generator=generator)))
    return out
