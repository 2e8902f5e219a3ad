"""Verification of a step's draft tokens, and the rollback of what it rejected.

A speculating chunk computed its last token and its k draft tokens d_1..d_k, and every position yielded logits.
Each position i draws the target's token x_i exactly as a plain decode step would (greedy: the argmax; sampled:
one draw from the processed distribution p_i). The draft is accepted while x_i == d_{i+1}; the first x_i that
differs (or x_k after k accepted drafts) is the target's own next token. For a proposer that names one token
(prompt lookup, a greedy draft model: q is a point mass) this is the speculative-sampling rule: d is accepted
with probability min(1, p(d)/q(d)) = p(d), and on rejection the token comes from p with d removed, normalised,
i.e. max(0, p - q) normalised (`rejection.py` has the general rule and a statistical test compares them). Greedy
output is therefore identical to decoding without speculation.

Accepted tokens are appended one by one with every stop condition checked after each (tokens after a stop are
dropped). Then the sequence is rolled back to what was verified: its computed count covers the accepted
tokens only, the blocks given to rejected positions are freed, and only blocks of verified tokens enter the
prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch

from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.sampling.sampler import SampleBatch, SampleRequest

if TYPE_CHECKING:
    from paged_backend.engine.spec_decode.policy import SpecPolicy
    from paged_backend.engine.token_processor import TokenProcessor


@dataclass
class SpecCounters:
    """Totals (vLLM's spec_decode counters): speculating rows verified, draft tokens, accepted draft tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def num_accepted(drafts: List[int], drawn: List[int]) -> int:
    """How many leading drafts equal the target's draws at their positions."""
    n = 0
    for draft, token in zip(drafts, drawn):
        if draft != token:
            break
        n += 1
    return n


class DraftVerifier:
    """Applies a step's speculating chunks: draws, acceptance, appended tokens, rollback."""

    def __init__(self, tokens: "TokenProcessor", policy: "SpecPolicy", counters: SpecCounters) -> None:
        self.tokens = tokens
        self.policy = policy
        self.counters = counters

    def verify(self, items: List[ScheduledSeq], logits: Optional[torch.Tensor]) -> None:
        """`logits`: the chunks' rows in order, 1 + k per chunk."""
        spans, requests = [], []
        for item in items:
            spans.append(len(requests))
            requests += [SampleRequest(item.group.sampling_params, item.seq, 1, None, (), False)] * item.num_tokens
        batch: Optional[SampleBatch] = None
        error: Optional[BaseException] = None
        try:
            batch = self.tokens.sampler.sample_batch(logits, requests)
            batch.complete()
        except Exception as exc:  # noqa: BLE001 - a batched stage failed: the speculating rows fail
            error = exc
        drafted = accepted = 0
        for item, first in zip(items, spans):
            drafts = item.seq.draft_token_ids
            n = 0
            if error is not None:
                self.tokens.fail_group(item.group, f"sampling failed: {type(error).__name__}: {error}")
            else:
                failed = [batch.failures[r] for r in range(first, first + item.num_tokens) if r in batch.failures]
                if failed:
                    self.tokens.fail_group(item.group, f"sampling failed: {failed[0]}")
                else:
                    drawn = [batch.tokens[batch.offsets[r]] for r in range(first, first + item.num_tokens)]
                    n = num_accepted(drafts, drawn)
                    self._append(item, batch, first, drawn[:n + 1])
            drafted += len(drafts)
            accepted += n
            self.policy.observe(item.seq.seq_id, len(drafts), n)
            self._roll_back(item, n)
        self.counters.num_drafts += len(items)
        self.counters.num_draft_tokens += drafted
        self.counters.num_accepted_tokens += accepted

    def _append(self, item: ScheduledSeq, batch: SampleBatch, first: int, tokens: List[int]) -> None:
        """Append the accepted tokens one at a time, each checked against the stop conditions."""
        group, seq = item.group, item.seq
        if group.error is not None or seq.is_finished():
            return   # it ended (aborted) since the step was launched: its tokens were computed in vain
        group.branched = True
        extras = batch.top_logprobs or batch.scores
        processor = self.tokens
        appended = 0
        for j, token in enumerate(tokens):
            row = first + j
            seq.token_ids.append(token)
            seq.cumulative_logprob += batch.logprobs[batch.offsets[row]]
            if extras:
                processor._keep_extras(seq, batch, row)
            appended += 1
            processor._finish_tokens([item])
            if seq.is_finished() or group.error is not None:
                break
        processor._note_tokens([item])
        processor.counters.num_generated_tokens += appended - 1

    def _roll_back(self, item: ScheduledSeq, accepted: int) -> None:
        """Only verified tokens count as computed: the last token and the accepted drafts (at most every token
        it has); the blocks of rejected positions are freed and the verified full blocks enter the prefix cache."""
        seq = item.seq
        seq.num_pending -= 1
        seq.draft_token_ids = []
        seq.num_computed_tokens = min(item.start + 1 + accepted, len(seq.token_ids))
        seq.max_computed_tokens = seq.num_computed_tokens
        bm = self.tokens.block_manager
        bm.release_slots_after(seq, seq.len_with_pending)
        if bm.prefix_cache is not None:
            bm.mark_computed(seq, seq.num_computed_tokens)
