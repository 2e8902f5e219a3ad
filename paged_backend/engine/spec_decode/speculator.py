"""The engine's side of speculative decoding before a step: which sequences speculate, their proposals (within
the step's token budget and the free KV blocks), and dropping the proposals the scheduler did not schedule.

A sequence speculates when its request runs one sequence (n = best_of = 1, no beam search), needs no per-row
processing (penalties, logits processors, min_tokens masking, structured output), is not a seeded sampled
request (its draws would depend on how many proposals the load allowed), and every one of its tokens is known:
only a step launched with nothing in flight proposes (see step_loop.py)."""

from __future__ import annotations

from typing import List, Set

from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_backend.engine.spec_decode.policy import SpecPolicy
from paged_backend.engine.spec_decode.proposer import Proposer
from paged_backend.engine.token_processor import SamplingPlan, StepRows


def speculates(group: SequenceGroup) -> bool:
    """Whether the request's sequence may speculate at all (its parameters allow it)."""
    params = group.sampling_params
    if params.use_beam_search or params.num_branches != 1 or len(group.seqs) != 1:
        return False
    if params.seed is not None and params.temperature >= 1e-6:
        return False
    plan = group.sampling_plan or SamplingPlan.of(group)
    return not plan.processed


def draw_temperature(group: SequenceGroup) -> float:
    """The temperature a proposer may draw the request's guesses at (0: name one token per position): sampled
    requests without logprobs or scores (their tokens' log-probabilities come from the rule's target rows)."""
    params = group.sampling_params
    if params.temperature < 1e-6 or params.logprobs is not None or params.output_scores:
        return 0.0
    return float(params.temperature)


def ready(seq: Sequence) -> bool:
    """A running sequence with exactly one token to compute, its last one, known (nothing pending)."""
    return (seq.status is SequenceStatus.RUNNING and not seq.num_pending and not seq.draft_token_ids
            and len(seq.token_ids) - seq.num_computed_tokens == 1)


class Speculator:
    """Proposes draft tokens for the sequences of a step about to be scheduled."""

    def __init__(self, proposer: Proposer, policy: SpecPolicy, block_manager: BlockManager,
                 max_num_batched_tokens: int) -> None:
        self.proposer = proposer
        self.policy = policy
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self._drafted: List[Sequence] = []
        self._proposed_for: Set[int] = set()   # sequences the proposer may keep something for

    @staticmethod
    def batch_size(running: List[SequenceGroup]) -> int:
        return sum(group.num_unfinished_seqs() for group in running)

    def close(self) -> None:
        """The proposer lets go of everything it keeps, for good (this speculator is replaced or the engine shut
        down)."""
        if self._proposed_for:
            self._release(list(self._proposed_for))
        self.proposer.shutdown()

    def forget(self, groups: List[SequenceGroup]) -> None:
        """The proposer lets go of what it keeps for these requests' sequences (they ended)."""
        ids = [seq.seq_id for group in groups for seq in group.seqs if seq.seq_id in self._proposed_for]
        if ids:
            self._release(ids)

    def _release(self, seq_ids: List[int]) -> None:
        self.proposer.release(seq_ids)
        self.policy.forget(seq_ids)
        self._proposed_for.difference_update(seq_ids)

    def propose(self, running: List[SequenceGroup]) -> None:
        """Set the draft tokens of the running sequences that speculate this step (and let the proposer forget
        the sequences that no longer run: preempted or ended)."""
        if self._proposed_for:
            gone = self._proposed_for - {seq.seq_id for group in running for seq in group.seqs}
            if gone:
                self._release(list(gone))
        batch = self.batch_size(running)
        k = self.policy.num_tokens(batch)
        if not k:
            return
        groups = [g for g in running if g.fork_pending_len is None and speculates(g) and ready(g.seqs[0])]
        if not groups:
            return
        seqs = [g.seqs[0] for g in groups]
        per_seq = self.policy.num_tokens_for
        limits = [per_seq(seq.seq_id, k) if seq.max_len is None
                  else max(0, min(per_seq(seq.seq_id, k), seq.max_len - len(seq.token_ids) - 1)) for seq in seqs]
        proposals = self.proposer.propose(seqs, limits, [draw_temperature(g) for g in groups])
        self._proposed_for.update(seq.seq_id for seq in seqs)
        bm = self.block_manager
        tokens_left = self.max_num_batched_tokens - batch            # every running sequence computes a token
        blocks_left = bm.get_num_free_blocks() - bm.watermark_blocks - batch   # and may take a block for it
        found = False
        for group, seq, drafts in zip(groups, seqs, proposals):
            if not drafts or tokens_left <= 0:
                continue
            length = len(seq.token_ids)
            have = bm.blocks_for(length)
            room = (have + max(0, blocks_left)) * bm.block_size - length   # draft slots the free blocks allow
            drafts = drafts[:min(tokens_left, room)]
            if not drafts:
                continue
            seq.draft_token_ids = list(drafts)
            probs = self.proposer.draft_probs(seq.seq_id) if draw_temperature(group) else None
            seq.draft_probs = None if probs is None else probs[:len(drafts)]   # None: verified by equality
            self._drafted.append(seq)
            tokens_left -= len(drafts)
            blocks_left -= bm.blocks_for(length + len(drafts)) - have
            found = True
        self.policy.proposed(found)

    def settle(self, sched: SchedulerOutput) -> None:
        """After scheduling: a sequence that was preempted or left out keeps no draft tokens (nor their slots)."""
        if not self._drafted:
            return
        scheduled = {id(item.seq) for item in sched.scheduled if item.samples}
        for seq in self._drafted:
            if id(seq) not in scheduled and seq.draft_token_ids:
                seq.draft_token_ids = []
                seq.draft_probs = None
                self.block_manager.release_slots_after(seq, seq.len_with_pending)
        self._drafted = []

    def wants_fresh_step(self, rows: StepRows, running: List[SequenceGroup]) -> bool:
        """Whether the step after this one should be launched once this one is processed (not overlapped), so
        that it can propose: some row of this step samples for a sequence that would speculate next."""
        if self.policy.num_tokens(self.batch_size(running)) == 0:
            return False
        return any(speculates(item.group) for item in rows.samplers)
