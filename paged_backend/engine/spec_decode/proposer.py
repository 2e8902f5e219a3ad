"""The interface every proposer implements: for some sequences, up to k guessed next tokens each."""

from __future__ import annotations

from typing import List, Optional, Protocol, Sequence as Seq

import torch

from paged_backend.core.sequence import Sequence


class Proposer(Protocol):
    """Guesses the next tokens of sequences whose every token is known (none is being sampled)."""

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int], temperatures: Seq[float]) -> List[List[int]]:
        """For each sequence at most `max_tokens[i]` proposed next tokens (an empty list: no guess); a proposer
        that can may draw the guesses of a sequence with `temperatures[i] > 0` from a distribution (see
        `draft_probs`), else it names one token per position."""

    def draft_probs(self, seq_id: int) -> Optional[torch.Tensor]:
        """The distributions ([k, V]) the last guesses of a sequence were drawn from; None: point masses."""

    def release(self, seq_ids: Seq[int]) -> None:
        """Forget whatever is kept for these sequences (they ended or were preempted)."""

    def shutdown(self) -> None:
        """Release what the proposer holds for good (a draft model's KV cache); it proposes no more."""
