"""Verification of a step's draft tokens, and the rollback of what it rejected.

A speculating chunk computed its last token and its k draft tokens d_1..d_k, and every position yielded logits.
Each position i draws the target's token x_i exactly as a plain decode step would (greedy: the argmax; sampled:
one draw from the processed distribution p_i). The draft is accepted while x_i == d_{i+1}; the first x_i that
differs (or x_k after k accepted drafts) is the target's own next token. For a proposer that names one token
(prompt lookup, a greedy draft model: q is a point mass) this is the speculative-sampling rule: d is accepted
with probability min(1, p(d)/q(d)) = p(d), and on rejection the token comes from p with d removed, normalised,
i.e. max(0, p - q) normalised. Greedy output is therefore identical to decoding without speculation. Drafts
drawn from a distribution q (a draft model on a sampled request) go through the general rule (rejection.py).

Accepted tokens are appended one by one with every stop condition checked after each (tokens after a stop are
dropped). Then the sequence is rolled back to what was verified: its computed count covers the accepted
tokens only, the blocks given to rejected positions are freed, and only blocks of verified tokens enter the
prefix cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.engine.spec_decode.rejection import speculative_sample, target_distributions
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
        starts, row = [], 0
        for item in items:
            starts.append(row)
            row += item.num_tokens
        outcomes: Dict[int, int] = {}   # index of the chunk -> its accepted drafts
        point = [i for i, item in enumerate(items) if item.seq.draft_probs is None]
        if point:
            rows = torch.cat([torch.arange(starts[i], starts[i] + items[i].num_tokens) for i in point])
            outcomes.update(self._verify_point_masses([items[i] for i in point], point, logits[rows]))
        for i, item in enumerate(items):
            if item.seq.draft_probs is not None:
                outcomes[i] = self._verify_drawn(item, logits[starts[i]:starts[i] + item.num_tokens])
        for i, item in enumerate(items):
            self.policy.observe(item.seq.seq_id, len(item.seq.draft_token_ids), outcomes[i])
            self.counters.num_draft_tokens += len(item.seq.draft_token_ids)
            self.counters.num_accepted_tokens += outcomes[i]
            self._roll_back(item, outcomes[i])
        self.counters.num_drafts += len(items)

    def _verify_point_masses(self, items: List[ScheduledSeq], indices: List[int],
                             logits: torch.Tensor) -> Dict[int, int]:
        """Drafts that name one token per position: each position draws the target's token as a plain step would
        (one batched sampler call for every row), and a draft stands while it equals the draw."""
        spans, requests = [], []
        for item in items:
            spans.append(len(requests))
            requests += [SampleRequest(item.group.sampling_params, item.seq, 1, None, (), False)] * item.num_tokens
        batch: Optional[SampleBatch] = None
        error: Optional[BaseException] = None
        try:
            batch = self.tokens.sampler.sample_batch(logits, requests)
        except Exception as exc:  # noqa: BLE001 - a batched stage failed: the speculating rows fail
            error = exc
        outcomes = {}
        for index, item, first in zip(indices, items, spans):
            outcomes[index] = 0
            if error is not None:
                self.tokens.fail_group(item.group, f"sampling failed: {type(error).__name__}: {error}")
                continue
            failed = [batch.failures[r] for r in range(first, first + item.num_tokens) if r in batch.failures]
            if failed:
                self.tokens.fail_group(item.group, f"sampling failed: {failed[0]}")
                continue
            drawn = [batch.tokens[batch.offsets[r]] for r in range(first, first + item.num_tokens)]
            n = outcomes[index] = num_accepted(item.seq.draft_token_ids, drawn)
            extras = batch.top_logprobs or batch.scores
            logprobs = batch.logprobs
            self._append(item, drawn[:n + 1],
                         (lambda j, first=first: logprobs[batch.offsets[first + j]]) if logprobs is not None else None,
                         (lambda seq, j, first=first: self.tokens._keep_extras(seq, batch, first + j)) if extras
                         else None)
        return outcomes

    def _verify_drawn(self, item: ScheduledSeq, logits: torch.Tensor) -> int:
        """Drafts drawn from a distribution q: the speculative-sampling rule against the target's distributions
        at their positions (rejection.py); returns how many drafts were accepted."""
        seq = item.seq
        request = SampleRequest(item.group.sampling_params, seq, 1, None, (), False)
        try:
            p = target_distributions(logits, [request] * item.num_tokens)
            tokens = speculative_sample(p, seq.draft_probs, seq.draft_token_ids, self.tokens.sampler.generator)
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self.tokens.fail_group(item.group, f"sampling failed: {type(exc).__name__}: {exc}")
            return 0
        log_p = [math.log(float(p[j, t])) for j, t in enumerate(tokens)]
        self._append(item, tokens, log_p.__getitem__, None)
        return len(tokens) - 1

    def _append(self, item: ScheduledSeq, tokens: List[int], logprob_of: Optional[Callable[[int], float]],
                keep_extras: Optional[Callable[[Any, int], None]]) -> None:
        """Append the accepted tokens one at a time, each checked against the stop conditions (`logprob_of` is
        None when the draws carry no log-probabilities: plain greedy rows)."""
        group, seq = item.group, item.seq
        if group.error is not None or seq.is_finished():
            return   # it ended (aborted) since the step was launched: its tokens were computed in vain
        group.branched = True
        processor = self.tokens
        appended = 0
        for j, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprob_of is not None:
                seq.cumulative_logprob += logprob_of(j)
            if keep_extras is not None:
                keep_extras(seq, j)
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
        seq.draft_probs = None
        seq.num_computed_tokens = min(item.start + 1 + accepted, len(seq.token_ids))
        seq.max_computed_tokens = seq.num_computed_tokens
        bm = self.tokens.block_manager
        bm.release_slots_after(seq, seq.len_with_pending)
        if bm.prefix_cache is not None:
            bm.mark_computed(seq, seq.num_computed_tokens)
