"""What the scheduler decides for one step (`SchedulerOutput`): the data the engine's input builder and token
processor read, without depending on the scheduler itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from paged_backend.core.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens [seq.num_computed_tokens, + num_tokens)."""

    group: SequenceGroup
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk ends at the sequence's last token, so the step samples its next one."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    """What the engine must do this step, in order: swap out, swap in, copy, then run the model."""

    scheduled: List[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: Dict[int, int] = field(default_factory=dict)
    blocks_to_swap_in: Dict[int, int] = field(default_factory=dict)
    blocks_to_copy: List[Tuple[int, int]] = field(default_factory=list)
    preempted: List[SequenceGroup] = field(default_factory=list)
    failed: List[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in
