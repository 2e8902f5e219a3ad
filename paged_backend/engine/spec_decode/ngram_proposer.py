"""Prompt lookup (vLLM's "ngram" method): the sequence's last n tokens are looked up earlier in it, and the tokens
that followed an earlier occurrence are proposed (the latest one followed by k tokens, else the earliest). The
longest n wins, from `prompt_lookup_max` down to `prompt_lookup_min`; numpy compares the whole token array at
once for each n."""

from __future__ import annotations

from typing import List, Sequence as Seq

import numpy as np

from paged_backend.core.sequence import Sequence


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> List[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest suffix of `tokens` (between
    `min_n` and `max_n` tokens long) that occurs earlier; [] when none does."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    # match[j]: tokens ending at position j (j < length - 1) equal the suffix over the last n tokens, n growing
    match = tokens[:-1] == tokens[-1]
    best = -1
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            match = match[1:] & (tokens[:length - n] == tokens[length - n])
            # match[i] now covers the window ending at position i + n - 1
        if not match.any():
            break
        if n >= min_n:
            ends = np.flatnonzero(match) + (n - 1)
            whole = ends[ends + k <= length - 1]   # occurrences followed by k known tokens
            best = int(whole[-1] if len(whole) else ends[0])   # the latest such, else the earliest (longest)
    if best < 0:
        return []
    return tokens[best + 1:best + 1 + k].tolist()


class NgramProposer:
    """Prompt-lookup proposals; keeps nothing between steps."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int], temperatures: Seq[float] = ()) -> List[List[int]]:
        return [ngram_lookup(np.asarray(seq.token_ids, dtype=np.int64), self.min_n, self.max_n, k) if k > 0 else []
                for seq, k in zip(seqs, max_tokens)]

    def draft_probs(self, seq_id: int) -> None:
        return None   # a looked-up token is a point mass

    def release(self, seq_ids: Seq[int]) -> None:
        return None

    def shutdown(self) -> None:
        return None
