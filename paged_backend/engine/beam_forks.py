"""A beam search step's decisions become sequences: a parent continued by several beams is forked (its blocks
shared), the first continuation reuses the parent, and a parent nobody continues is freed at once."""

from __future__ import annotations

from typing import List, Optional, Tuple

from paged_backend.core.block_manager import BlockManager
from paged_backend.core.sequence import Sequence
from paged_backend.sampling.beam_search import BeamDecision
from paged_backend.structured.matcher import accept_grammar


def group_children(decisions: List[BeamDecision], num_parents: int) -> List[List[Tuple[int, BeamDecision]]]:
    """For each parent beam, the (new position, decision) pairs that continue it."""
    children: List[List[Tuple[int, BeamDecision]]] = [[] for _ in range(num_parents)]
    for position, decision in enumerate(decisions):
        children[decision.parent].append((position, decision))
    return children


def apply_beam_decisions(live: List[Sequence], decisions: List[BeamDecision],
                         block_manager: BlockManager) -> List[Sequence]:
    """The new live beams in ranking order. If mapping fails, the children forked so far are freed before the
    error propagates (the caller fails the request, which frees the parents): a failed step holds no block."""
    new_live: List[Optional[Sequence]] = [None] * len(decisions)
    forked: List[Sequence] = []
    try:
        for parent, children in zip(live, group_children(decisions, len(live))):
            if not children:
                block_manager.free(parent)
                continue
            for position, decision in children[1:]:
                child = parent.fork()
                block_manager.fork(parent, child)
                forked.append(child)
                _extend(child, decision)
                new_live[position] = child
            position, decision = children[0]
            _extend(parent, decision)
            new_live[position] = parent
    except BaseException:
        for child in forked:
            block_manager.free(child)
        raise
    return [seq for seq in new_live if seq is not None]


def _extend(seq: Sequence, decision: BeamDecision) -> None:
    accept_grammar(seq, decision.token_id)  # the beam search kept only allowed candidates: a refusal is a bug
    seq.append_token(decision.token_id, decision.logprob)
    seq.cumulative_logprob = decision.score
    seq.beam_indices.append(decision.parent)
