"""What the scheduler decides for one step (`SchedulerOutput`): the data the engine's input builder and token
processor read, without depending on the scheduler itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from paged_backend.core.sequence import Sequence, SequenceGroup


class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + num_tokens), `start` being its computed count when
    it was scheduled; `samples` when the chunk ends at its last token (pending ones included), so the step
    samples its next one. Fixed at scheduling: the engine advances the sequence as soon as the step is launched."""

    __slots__ = ("group", "seq", "num_tokens", "start", "samples")

    def __init__(self, group: SequenceGroup, seq: Sequence, num_tokens: int) -> None:
        self.group = group
        self.seq = seq
        self.num_tokens = num_tokens
        self.start = seq.num_computed_tokens
        self.samples = self.start + num_tokens == seq.len_with_pending

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def __repr__(self) -> str:
        return f"ScheduledSeq({self.group.request_id!r}, seq={self.seq.seq_id}, [{self.start}, {self.end}))"


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
