"""Iteration-level scheduler: which requests run in the next step, and which are preempted.

Every step it keeps running requests going (first come, first served), preempting whole requests
from the back when their next slots do not fit, brings swapped requests back, and only then admits
waiting ones. Prompts larger than the token budget are prefilled in chunks. A request that can never
be scheduled fails with an error instead of waiting forever.

Admission is on demand until a preemption shows that the running requests outgrow the cache; then, for
`admission_backoff_steps` steps, a new request also leaves room for the running ones to grow (`_growth_blocks`):
a preempted request's blocks are recomputed or copied, work that a request admitted a little later never costs.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, Iterable, List, Optional

from paged_backend.config import SchedulerConfig
from paged_backend.core.block_manager import AllocStatus, BlockManager
from paged_backend.core.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus


class _Budget:
    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.tokens = max_tokens
        self.max_seqs = max_seqs
        self.seqs = 0


def common_prefix_len(seqs: List[Sequence]) -> int:
    """Tokens that every sequence starts with, leaving each at least one token of its own to compute
    (so that each gets logits to sample from when it is recomputed)."""
    first = seqs[0].token_ids
    length = min(len(s) for s in seqs) - 1
    for seq in seqs[1:]:
        ids = seq.token_ids
        n = 0
        while n < length and ids[n] == first[n]:
            n += 1
        length = n
    return length


class Scheduler:
    """Waiting, running and swapped queues of whole requests over one block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_loras: Optional[int] = None,
                 swap_single: bool = False) -> None:
        self.config = config
        # Without a preemption_mode, a request of one sequence is swapped where copying its blocks costs less than
        # recomputing them (a CPU device: the host pool is the same memory), else recomputed (vLLM's default).
        self.swap_single = swap_single
        self.block_manager = block_manager
        self.max_loras = max_loras  # LoRA adapters that may run at once (the device's slots); None: no adapters
        self.waiting: Deque[SequenceGroup] = deque()
        self.running: List[SequenceGroup] = []
        self.swapped: List[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        # the share of their remaining tokens the running sequences keep room for at admission: 1 after a
        # preemption, falling by 1 / admission_backoff_steps per step to 0 (on-demand admission)
        self.growth_share = 0.0

    # ---- queues ------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort(self, request_id: str) -> Optional[SequenceGroup]:
        """Remove a request wherever it is and free its blocks; returns it, or None if unknown."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.finish_group(group, SequenceStatus.FINISHED_ABORTED)
                    return group
        return None

    def fail(self, group: SequenceGroup, error: str) -> None:
        """End a request with an error wherever it is; its blocks are freed."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        group.abort(error)
        self.block_manager.free_group(group)

    def finish_group(self, group: SequenceGroup, status: SequenceStatus, error: Optional[str] = None) -> None:
        for seq in group.unfinished_seqs():
            seq.status = status
        if error is not None:
            group.error = error
        group.fork_pending_len = None
        self.block_manager.free_group(group)

    def free_finished(self) -> List[SequenceGroup]:
        """Free the blocks of finished sequences; drop finished requests from the running queue."""
        tables = self.block_manager.block_tables
        done = []
        for group in self.running:
            for seq in group.seqs:
                if seq.seq_id in tables and seq.is_finished():
                    self.block_manager.free(seq)
            if group.is_finished():
                done.append(group)
        if done:
            self.running = [g for g in self.running if not g.is_finished()]
        return done

    def discard_finished(self, group: SequenceGroup) -> None:
        """A request that finished while it was preempted (with overlapped scheduling its last token can arrive
        after the scheduler swapped it out or queued it for recomputation): it leaves its queue and frees its
        blocks."""
        for queue in (self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
                self.finish_group(group, SequenceStatus.FINISHED_ABORTED)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        kept = self._keep_running(out)
        budget.seqs = sum(g.max_num_running_seqs() for g in kept)
        if not out.preempted:
            kept += self._swap_in(out, budget, {g.lora_int_id for g in kept})
        self.running = kept
        self._schedule_tokens(kept, out, budget)
        if not out.preempted and not self.swapped:
            self._admit_waiting(out, budget)
        if out.is_empty and not out.failed and not self.running:
            self._fail_unschedulable_head(out)
        if self.growth_share > 0.0:
            self.growth_share = max(0.0, self.growth_share - 1.0 / self.config.admission_backoff_steps)
        return out

    def _keep_running(self, out: SchedulerOutput) -> List[SequenceGroup]:
        """Give every running request slots for its next tokens, preempting from the back."""
        ordered = sorted(self.running, key=lambda g: g.metrics.arrival_time)
        if self._decode_all(ordered):
            return ordered
        queue = deque(ordered)
        kept: List[SequenceGroup] = []
        bm = self.block_manager
        while queue:
            group = queue.popleft()
            self._fork_recomputed(group)
            while not bm.can_append_slots(group):
                if queue:
                    self._preempt(queue.pop(), out)
                    continue
                if kept:
                    self._preempt(group, out)
                else:
                    needed = bm.num_blocks_to_append(group.get_seqs(SequenceStatus.RUNNING))
                    self.finish_group(group, SequenceStatus.FINISHED_ABORTED,
                                      f"request {group.request_id!r} needs {needed} more KV blocks than the cache "
                                      f"has free ({bm.get_num_free_blocks()} of {bm.num_blocks}) even running alone")
                    out.failed.append(group)
                break
            else:
                self._append_slots(group, out)
                kept.append(group)
        return kept

    def _decode_all(self, groups: List[SequenceGroup]) -> bool:
        """The common step: every running sequence decodes one token (or has none left to compute: its pending
        token is its last) and their new blocks are free. Then every request keeps running and its slots come
        from one batched call; False (nothing changed) otherwise."""
        if not self.block_manager.batched_decode:
            return False
        seqs = []
        running = SequenceStatus.RUNNING
        for group in groups:
            if group.fork_pending_len is not None:
                return False
            for seq in group.seqs:
                if seq.status is running:
                    if seq.len_with_pending - seq.num_computed_tokens > 1:
                        return False
                    seqs.append(seq)
        return self.block_manager.append_decode_slots(seqs)

    def _append_slots(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            out.blocks_to_copy += self.block_manager.append_slots(seq)

    def _fork_recomputed(self, group: SequenceGroup) -> None:
        """Once the leader of a recomputed request has its common prefix in the cache, the other
        sequences fork from it (sharing those blocks) and compute only their own tails."""
        length = group.fork_pending_len
        if length is None:
            return
        leader, *others = group.unfinished_seqs()
        if leader.num_computed_tokens < length or leader.status != SequenceStatus.RUNNING:
            return
        for seq in others:
            self.block_manager.fork(leader, seq, length)
            seq.num_computed_tokens = length
            seq.status = SequenceStatus.RUNNING
        group.fork_pending_len = None

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        mode = self.config.preemption_mode
        if mode is None:
            mode = "recompute" if group.max_num_running_seqs() == 1 and not self.swap_single else "swap"
        bm = self.block_manager
        if mode == "swap" and not bm.can_swap_out(group, out.blocks_to_swap_out):
            mode = "recompute"
        if mode == "swap":
            bm.swap_out(group, out.blocks_to_swap_out)
            group.set_status(SequenceStatus.SWAPPED)
            self.swapped.append(group)
            self.num_swap_preemptions += 1
        else:
            for seq in group.active_seqs():
                bm.free(seq, will_recompute=True)
                seq.num_computed_tokens = 0
            group.set_status(SequenceStatus.WAITING)
            unfinished = group.unfinished_seqs()
            if len(unfinished) > 1:
                group.fork_pending_len = common_prefix_len(unfinished)
            self.waiting.appendleft(group)
            self.num_recompute_preemptions += 1
        group.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group)
        if self.config.admission_backoff_steps:
            self.growth_share = 1.0

    def _swap_in(self, out: SchedulerOutput, budget: _Budget, adapters: set) -> List[SequenceGroup]:
        """Bring swapped requests back in arrival order while blocks and the sequence budget allow;
        a request that could not come back even to an empty cache fails."""
        self.swapped.sort(key=lambda g: g.metrics.arrival_time)
        back: List[SequenceGroup] = []
        bm = self.block_manager
        deferred: List[SequenceGroup] = []
        while self.swapped:
            group = self.swapped[0]
            if not self._adapter_fits(group, adapters):
                deferred.append(self.swapped.pop(0))
                continue
            status = bm.can_swap_in(group, out.blocks_to_swap_in)
            if status == AllocStatus.NEVER:
                self.swapped.pop(0)
                self.finish_group(group, SequenceStatus.FINISHED_ABORTED,
                                  f"request {group.request_id!r} was swapped out and now needs more KV blocks "
                                  f"than the whole cache holds ({bm.num_blocks} blocks of {bm.block_size} tokens)")
                out.failed.append(group)
                continue
            if status == AllocStatus.LATER or budget.seqs + group.max_num_running_seqs() > budget.max_seqs:
                break
            self.swapped.pop(0)
            bm.swap_in(group, out.blocks_to_swap_in)
            group.set_status(SequenceStatus.RUNNING)
            self._append_slots(group, out)
            budget.seqs += group.max_num_running_seqs()
            back.append(group)
            adapters.add(group.lora_int_id)
        self.swapped[:0] = deferred
        return back

    @staticmethod
    def _to_compute(group: SequenceGroup) -> List[Sequence]:
        """Running sequences with tokens left to compute (a beam that already has its logits waits
        for its siblings)."""
        return [s for s in group.get_seqs(SequenceStatus.RUNNING) if s.num_uncomputed_tokens > 0]

    def _schedule_tokens(self, groups: List[SequenceGroup], out: SchedulerOutput, budget: _Budget) -> None:
        """Decode tokens first (one per sequence, with its draft tokens when it speculates), then prefill chunks,
        within the token budget."""
        prefilling = []
        running = SequenceStatus.RUNNING
        scheduled = out.scheduled
        for group in groups:
            seqs = []
            prefill = False
            tokens = 0
            for seq in group.seqs:
                if seq.status is running:
                    todo = seq.len_with_pending - seq.num_computed_tokens
                    if todo > 1 and not seq.draft_token_ids:
                        prefill = True
                        break
                    if todo >= 1:  # a decode token, and the draft tokens verified with it (speculative decoding)
                        seqs.append(seq)
                        tokens += todo
            if prefill:
                prefilling.append(group)
                continue
            if tokens > budget.tokens:
                continue  # cannot happen while the token budget covers max_num_seqs; never starve the rest
            for seq in seqs:
                scheduled.append(ScheduledSeq(group, seq, seq.len_with_pending - seq.num_computed_tokens))
            budget.tokens -= tokens
        for group in prefilling:
            self._schedule_chunks(group, out, budget)

    def _schedule_chunks(self, group: SequenceGroup, out: SchedulerOutput, budget: _Budget) -> None:
        for seq in self._to_compute(group):
            todo = seq.num_uncomputed_tokens
            if group.fork_pending_len is not None:  # the leader stops at the prefix its siblings fork from
                todo = group.fork_pending_len - seq.num_computed_tokens
            chunk = min(todo, budget.tokens)
            if chunk <= 0:
                return
            if self.block_manager.sliding_window is not None:  # its chunk's slots come from the blocks free now
                chunk = self.block_manager.grow_for_chunk(seq, chunk)
            out.scheduled.append(ScheduledSeq(group, seq, chunk))
            budget.tokens -= chunk

    def _admit_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        bm = self.block_manager
        adapters = self._running_adapters()
        deferred: List[SequenceGroup] = []
        reserve = None   # blocks the running sequences keep for growth, counted once when first needed
        while self.waiting and budget.tokens > 0:
            group = self.waiting[0]
            if not self._adapter_fits(group, adapters):
                deferred.append(self.waiting.popleft())   # it waits for a slot; later requests may go first
                continue
            status = bm.can_allocate(group)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self.finish_group(group, SequenceStatus.FINISHED_ABORTED,
                                  f"request {group.request_id!r} needs {bm.admission_blocks(group)} KV blocks for "
                                  f"its {sum(len(s) for s in group.unfinished_seqs())} tokens but the cache holds "
                                  f"only {bm.num_blocks} blocks of {bm.block_size} tokens")
                out.failed.append(group)
                continue
            if status == AllocStatus.LATER:
                break
            if budget.seqs + group.max_num_running_seqs() > budget.max_seqs:
                break
            if self.growth_share > 0.0 and self.running:
                if reserve is None:
                    reserve = self._growth_blocks(s for g in self.running for s in g.get_seqs(SequenceStatus.RUNNING))
                own = self._growth_blocks(group.active_seqs())
                if bm.get_num_free_blocks() - bm.admission_blocks(group) - bm.watermark_blocks < reserve + own:
                    break
                reserve += own
            self.waiting.popleft()
            bm.allocate(group)
            group.set_status(SequenceStatus.RUNNING)
            self._fork_recomputed(group)  # the prefix may already be cached
            self._append_slots(group, out)
            budget.seqs += group.max_num_running_seqs()
            self.running.append(group)
            adapters.add(group.lora_int_id)
            self._schedule_chunks(group, out, budget)
        self.waiting.extendleft(reversed(deferred))

    def _growth_blocks(self, seqs: Iterable[Sequence]) -> int:
        """Blocks that `seqs` would add growing by `growth_share` of the tokens their length limit (max_tokens or
        the context) still allows them; none under a sliding window, where a sequence holds a window's blocks."""
        bm, share = self.block_manager, self.growth_share
        if bm.sliding_window is not None:
            return 0
        blocks = 0
        for seq in seqs:
            length = seq.len_with_pending
            if seq.max_len is not None and seq.max_len > length:
                blocks += bm.blocks_for(length + math.ceil(share * (seq.max_len - length))) - bm.blocks_for(length)
        return blocks

    # ---- LoRA adapters -----------------------------------------------------------------------
    def _running_adapters(self) -> set:
        """The adapter ids of the running requests (0, the base model, included when present)."""
        return {g.lora_int_id for g in self.running}

    def _adapter_fits(self, group: SequenceGroup, adapters: set) -> bool:
        """A request may run with the running ones unless it brings one adapter too many (`max_loras`)."""
        lora_id = group.lora_int_id
        if lora_id == 0 or lora_id in adapters or self.max_loras is None:
            return True
        return len(adapters - {0}) < self.max_loras

    def _fail_unschedulable_head(self, out: SchedulerOutput) -> None:
        """Nothing runs and nothing could be scheduled: the head request would wait forever for a cache
        that is already empty, so it fails (the step reports it) instead of the engine spinning."""
        group = self.swapped[0] if self.swapped else (self.waiting[0] if self.waiting else None)
        if group is None:
            return
        self.fail(group, f"request {group.request_id!r} cannot be scheduled even with nothing else running "
                         f"({self.block_manager.get_num_free_blocks()} of {self.block_manager.num_blocks} KV "
                         f"blocks free, token budget {self.config.max_num_batched_tokens}, "
                         f"max_num_seqs {self.config.max_num_seqs})")
        out.failed.append(group)
