"""A stand-in proposer for speculative-decoding tests: it proposes a request's known continuation (from a run
without speculation), with one token wrong at a position that cycles through 0..k+1 step by step, so that
verification sees every outcome: the first draft rejected, a few accepted, all accepted."""

from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Tuple


class OracleProposer:
    def __init__(self, continuations: Dict[Tuple[int, ...], List[int]]) -> None:
        self.continuations = continuations   # prompt token ids -> the output tokens without speculation
        self._calls = itertools.count()

    def propose(self, seqs, max_tokens: Sequence[int], temperatures: Sequence[float] = ()) -> List[List[int]]:
        out = []
        for seq, k in zip(seqs, max_tokens):
            known = self.continuations.get(tuple(seq.token_ids[:seq.prompt_len]))
            if known is None or seq.output_token_ids != known[:seq.num_output_tokens]:
                out.append([])
                continue
            drafts = list(known[seq.num_output_tokens:seq.num_output_tokens + k])
            wrong = next(self._calls) % (k + 2)
            if wrong < len(drafts):
                drafts[wrong] = 3 + (drafts[wrong] + 1) % 997
            out.append(drafts)
        return out

    def draft_probs(self, seq_id: int) -> None:
        return None

    def release(self, seq_ids) -> None:
        return None

    def shutdown(self) -> None:
        return None


def with_oracle(engine, outputs) -> None:
    """Give a speculating engine the oracle built from `outputs` (prompt token ids -> output token ids)."""
    engine.speculator.proposer = OracleProposer({tuple(p): list(o) for p, o in outputs})
