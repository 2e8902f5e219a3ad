"""`Sequence` (one stream of tokens with its KV state) and `SequenceGroup` (one request's sequences)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # core imports no torch: the parameters module pulls in the logits processors' types
    from paged_backend.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


_STOPPED, _LENGTH, _ABORTED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                               SequenceStatus.FINISHED_ABORTED)
_seq_counter = itertools.count()


class Sequence:
    """Token ids of one sequence (prompt then output) and how many of them have K/V in the cache.

    Every token whose K/V is not yet computed is fed to the model in a later step: a fresh prompt,
    a prompt chunk, a recomputation after preemption and a decode step are the same thing here.
    """

    def __init__(self, prompt_token_ids: List[int], seq_id: Optional[int] = None,
                 cache_salt: Optional[bytes] = None) -> None:
        self.seq_id = next(_seq_counter) if seq_id is None else seq_id
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: List[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # tokens that launched steps are sampling for this sequence and that are not appended yet (with
        # overlapped scheduling the next step is scheduled before the previous one's token is known)
        self.num_pending = 0
        # proposed next tokens (speculative decoding) that the step being scheduled verifies after its last
        # token: they have slots and are computed with it, and are never part of `token_ids` until accepted
        self.draft_token_ids: List[int] = []
        self.draft_probs: Any = None   # the distributions the drafts were drawn from ([k, V]; None: point masses)
        self.max_len: Optional[int] = None  # the length at which it certainly ends (max_tokens, the context)
        self.max_computed_tokens = 0  # high-water mark: tokens below it computed again are recomputation
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: List[Dict[int, float]] = []
        self.output_scores: List[Any] = []
        self.beam_indices: List[int] = []  # beam search: the live beam this sequence extended at each step
        self.output_text = ""
        self.detok_prefix_offset = 0
        self.detok_read_offset = 0
        self.detok_prefix_text = ""  # text of token_ids[detok_prefix_offset:detok_read_offset]
        self.detok_started = False
        self.stop_reason: Optional[object] = None
        self.block_hashes: List[bytes] = []
        self.cache_salt = cache_salt  # the first block's hash starts from it (a LoRA adapter, a salt): no sharing across
        self.generator: Any = None  # this sequence's own RNG when the request has a seed (set by the engine)
        self.grammar: Any = None    # its structured-output matcher state (structured_matcher.GrammarState)

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def len_with_pending(self) -> int:
        """Its length once the tokens being sampled for it are appended (and its draft tokens, while they are
        verified), what its slots must cover; a pending token that ends it (it reaches `max_len`) does not
        count: its K/V is never computed."""
        length = len(self.token_ids) + self.num_pending + len(self.draft_token_ids)
        if self.num_pending and self.max_len is not None and length >= self.max_len:
            return length - 1
        return length

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.len_with_pending - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token waits for its K/V (a prompt or a recomputation)."""
        return self.num_uncomputed_tokens > 1

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def is_finished(self) -> bool:
        status = self.status  # identity tests: an enum's hash is a Python call
        return status is _STOPPED or status is _LENGTH or status is _ABORTED

    def fork(self) -> "Sequence":
        """A copy with a new id, field by field: lists are copied, the grammar state forked, and the RNG left to
        the caller (a seeded sample gets its own stream); the caller shares the parent's blocks through the
        block manager. A field added to `__init__` must be added here too (a test holds them equal)."""
        child = Sequence.__new__(Sequence)
        child.seq_id = next(_seq_counter)
        child.prompt_len = self.prompt_len
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_pending = self.num_pending
        child.draft_token_ids = list(self.draft_token_ids)
        child.draft_probs = self.draft_probs
        child.max_len = self.max_len
        child.max_computed_tokens = self.max_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.output_scores = list(self.output_scores)
        child.beam_indices = list(self.beam_indices)
        child.output_text = self.output_text
        child.detok_prefix_offset = self.detok_prefix_offset
        child.detok_read_offset = self.detok_read_offset
        child.detok_prefix_text = self.detok_prefix_text
        child.detok_started = self.detok_started
        child.stop_reason = self.stop_reason
        child.block_hashes = list(self.block_hashes)
        child.cache_salt = self.cache_salt
        child.generator = None
        child.grammar = None if self.grammar is None else self.grammar.fork()
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self.token_ids)}, computed={self.num_computed_tokens}, "
                f"status={self.status.name})")


@dataclass
class RequestMetrics:
    """Timestamps of one request, for latency statistics."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


class SequenceGroup:
    """One request: its prompt, its parameters and the sequences (samples or beams) it runs."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                 sampling_params: SamplingParams, arrival_time: Optional[float] = None,
                 eos_token_ids: Optional[List[int]] = None, lora_request: Any = None,
                 cache_salt: Optional[bytes] = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # the tokens that end this request's sequences: EOS unless ignored, then its stop_token_ids
        self.stop_ids: Tuple[int, ...] = ((() if sampling_params.ignore_eos else tuple(eos_token_ids or ()))
                                          + tuple(sampling_params.stop_token_ids))
        self.lora_request = lora_request   # the request's LoRA adapter (engine.lora_request.LoRARequest) or None
        self.seqs: List[Sequence] = [Sequence(self.prompt_token_ids, cache_salt=cache_salt)]
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.branched = False       # the prompt's first sample has been forked into best_of / beam_width seqs
        self.beam_state: Any = None  # finished hypotheses of a beam search (set by the engine)
        # Recomputation of a request with several sequences: the first unfinished sequence (the leader)
        # recomputes their common prefix of this many tokens alone, then the others fork from it.
        self.fork_pending_len: Optional[int] = None
        self.error: Optional[str] = None
        self.num_preemptions = 0
        self.sampling_plan: Any = None  # what the engine works out once about sampling its rows (token_processor)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def get_seqs(self, status: Optional[SequenceStatus] = None) -> List[Sequence]:
        if status is None:
            return list(self.seqs)
        return [seq for seq in self.seqs if seq.status == status]

    def unfinished_seqs(self) -> List[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished()]

    def num_unfinished_seqs(self) -> int:
        return sum(1 for seq in self.seqs if not seq.is_finished())

    def max_num_running_seqs(self) -> int:
        """Sequences this request will run at once: what the scheduler's sequence budget must allow."""
        if not self.branched and not self.is_finished():
            return self.sampling_params.num_branches
        return self.num_unfinished_seqs()

    def is_finished(self) -> bool:
        for seq in self.seqs:
            status = seq.status
            if not (status is _STOPPED or status is _LENGTH or status is _ABORTED):
                return False
        return True

    def pending_forks(self) -> List[Sequence]:
        """Sequences waiting for the leader to recompute their common prefix before they fork from it."""
        if self.fork_pending_len is None:
            return []
        return self.unfinished_seqs()[1:]

    def active_seqs(self) -> List[Sequence]:
        """Unfinished sequences that hold blocks or are about to (all but the pending forks)."""
        unfinished = self.unfinished_seqs()
        return unfinished[:1] if self.fork_pending_len is not None else unfinished

    def set_status(self, status: SequenceStatus) -> None:
        """Move the active sequences; pending forks stay waiting until they fork."""
        for seq in self.active_seqs():
            seq.status = status

    def abort(self, error: str) -> None:
        """End the request with an error: its unfinished sequences are aborted (their blocks are freed by whoever
        holds them: the scheduler at the end of the step). The first error is kept."""
        for seq in self.unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
        if self.error is None:
            self.error = error
        self.fork_pending_len = None

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={len(self.seqs)})"
