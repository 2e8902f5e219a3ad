"""How many tokens to propose per sequence this step (adaptive k), from the batch size and the acceptance rate.

The rule (docs/speculative.md):
- no speculation while the running batch has more than `disable_by_batch_size` sequences;
- under load k shrinks so that a step verifies about `TOKENS_PER_STEP` tokens: k <= TOKENS_PER_STEP // batch - 1
  (at least 1);
- with a measured acceptance rate a (an exponential moving average over verified draft tokens) the i-th draft
  is reached and accepted with chance about a^i, and only drafts with a chance of at least 1/4 are proposed:
  k <= log(1/4) / log(a) (at least 1; all k while a is 1 or nothing was measured yet);
- a step whose proposer found nothing for any sequence backs off: the next 1, 2, 4, ... 16 steps do not try
  (they may then overlap with the step before, see step_loop.py), and a step with proposals resets it.
"""

from __future__ import annotations

import math

TOKENS_PER_STEP = 64   # tokens one step verifies at most before k shrinks (batch * (1 + k))
DECAY = 0.9            # weight of the past in the acceptance-rate average, per verified step
MAX_BACKOFF = 16       # steps without proposals, at most, after steps that found none
MIN_DRAFT_CHANCE = 0.25  # a draft is proposed while its chance to be reached and accepted is at least this


class SpecPolicy:
    """The adaptive-k rule and what it measures."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self._drafted = 0.0    # decayed counts of verified draft tokens and accepted ones
        self._accepted = 0.0
        self._backoff = 0
        self.skip = 0          # steps left before proposals are tried again

    @property
    def acceptance_rate(self) -> float:
        """The moving average of accepted / proposed tokens (1.0 before anything was verified)."""
        return self._accepted / self._drafted if self._drafted else 1.0

    def num_tokens(self, batch_size: int) -> int:
        """k for each sequence of a step that runs `batch_size` sequences (0: no speculation)."""
        if self.skip or batch_size > self.disable_by_batch_size or batch_size < 1:
            return 0
        k = min(self.k, max(1, TOKENS_PER_STEP // batch_size - 1))
        rate = self.acceptance_rate
        if rate < 1.0:
            k = min(k, max(1, int(math.log(MIN_DRAFT_CHANCE) / math.log(rate)) if rate > 0 else 1))
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified step: `drafted` tokens were proposed, `accepted` of them accepted."""
        if drafted:
            self._drafted = DECAY * self._drafted + drafted
            self._accepted = DECAY * self._accepted + accepted

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
