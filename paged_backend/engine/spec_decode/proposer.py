"""The interface every proposer implements: for some sequences, up to k guessed next tokens each."""

from __future__ import annotations

from typing import List, Protocol, Sequence as Seq

from paged_backend.core.sequence import Sequence


class Proposer(Protocol):
    """Guesses the next tokens of sequences whose every token is known (none is being sampled)."""

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> List[List[int]]:
        """For each sequence at most `max_tokens[i]` proposed next tokens (an empty list: no guess)."""

    def release(self, seq_ids: Seq[int]) -> None:
        """Forget whatever is kept for these sequences (they ended or were preempted)."""

    def shutdown(self) -> None:
        """Release what the proposer holds for good (a draft model's KV cache); it proposes no more."""
