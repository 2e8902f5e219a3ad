"""How many tokens to propose per sequence this step (adaptive k), from the batch size and the acceptance rate.

The rule (docs/speculative.md):
- no speculation while the running batch has more than `disable_by_batch_size` sequences;
- under load k shrinks so that a step verifies about `TOKENS_PER_STEP` tokens: k <= TOKENS_PER_STEP // batch - 1
  (at least 1);
- per sequence, with its acceptance rate a (a moving average, weight 1/2 per verified step, of the share of its
  drafts accepted; 1 before its first verification) the i-th draft is reached and accepted with chance about
  a^i, and only drafts with a chance of at least 1/4 are proposed: k <= log(1/4) / log(a) (at least 1): a
  sequence that stops copying falls to one draft per step at once, and is back to k after three steps of
  accepted drafts;
- a step whose proposer found nothing for any sequence backs off: the next 1, 2, 4, ... 16 steps do not try
  (they may then overlap with the step before, see step_loop.py), and a step with proposals resets it.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable

TOKENS_PER_STEP = 64   # tokens one step verifies at most before k shrinks (batch * (1 + k))
DECAY = 0.5            # weight of a sequence's past in its acceptance rate, per verified step
MAX_BACKOFF = 16       # steps without proposals, at most, after steps that found none
MIN_DRAFT_CHANCE = 0.25  # a draft is proposed while its chance to be reached and accepted is at least this


def drafts_for_rate(rate: float, k: int) -> int:
    """The most drafts worth proposing at acceptance rate `rate` (at most k, at least 1)."""
    if rate >= 1.0:
        return k
    if rate <= 0.0:
        return 1
    return max(1, min(k, int(math.log(MIN_DRAFT_CHANCE) / math.log(rate))))


class SpecPolicy:
    """The adaptive-k rule and what it measures."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.rates: Dict[int, float] = {}   # seq_id -> its acceptance rate (moving average)
        self._backoff = 0
        self.skip = 0          # steps left before proposals are tried again

    def num_tokens(self, batch_size: int) -> int:
        """k for the sequences of a step that runs `batch_size` sequences (0: no speculation)."""
        if self.skip or batch_size > self.disable_by_batch_size or batch_size < 1:
            return 0
        return min(self.k, max(1, TOKENS_PER_STEP // batch_size - 1))

    def num_tokens_for(self, seq_id: int, k: int) -> int:
        """k for one sequence, given the step's k."""
        return drafts_for_rate(self.rates.get(seq_id, 1.0), k)

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verified row: `drafted` tokens were proposed for the sequence, `accepted` of them accepted."""
        if drafted:
            self.rates[seq_id] = DECAY * self.rates.get(seq_id, 1.0) + (1 - DECAY) * accepted / drafted

    def forget(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            self.rates.pop(sid, None)

    def proposed(self, found: bool) -> None:
        """A step tried to propose; `found`: some sequence got proposals."""
        if found:
            self._backoff = 0
        else:
            self._backoff = min(MAX_BACKOFF, max(1, 2 * self._backoff))
            self.skip = self._backoff

    def tick(self) -> None:
        """A step was launched."""
        if self.skip:
            self.skip -= 1
