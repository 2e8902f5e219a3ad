"""What the engine returns per request: `RequestOutput` holding one `CompletionOutput` per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple

from paged_backend.sampling.logprob import Logprob

if TYPE_CHECKING:
    import torch


def ranked(top: Optional[Mapping[int, float]], k: Optional[int] = None) -> List[Tuple[int, float]]:
    """A position's top logprobs best first ((token id, logprob) pairs), the first `k` of them: by the engine's
    rank where it gives one, else by value. The one ordering every front uses."""
    def order(item: Tuple[int, float]) -> tuple:
        rank = getattr(item[1], "rank", None)
        return (rank if rank is not None else float("inf"), -float(item[1]))

    items = sorted((top or {}).items(), key=order)
    return items if k is None else items[:k]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a sample or a beam)."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]       # None unless the request reports logprobs (SamplingParams.reports_logprobs)
    logprobs: Optional[List[Dict[int, Logprob]]] = None   # per new token: its top logprobs and its own, ranked
    finish_reason: Optional[str] = None       # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None      # the stop string or stop token id that ended it
    beam_score: Optional[float] = None        # beam search: cumulative_logprob / len ** length_penalty
    # SamplingParams(output_scores=True), sampling and greedy: one float32 `[vocab]` row per generated token,
    # the processed scores the token was drawn from and the raw logits of the model.
    scores: Optional[List["torch.Tensor"]] = None
    logits: Optional[List["torch.Tensor"]] = None
    # beam search: for each generated token, the live beam (row of that step's `RequestOutput.step_scores`) it extended
    beam_indices: Optional[List[int]] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step; `finished` once every sequence is done."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    error: Optional[str] = None
    metrics: Dict[str, Optional[float]] = field(default_factory=dict)
    # beam search with SamplingParams(output_scores=True): per step, float32 `[live beams, vocab]` processed
    # log-probs of the live beams (best first) and their raw logits
    step_scores: Optional[List["torch.Tensor"]] = None
    step_logits: Optional[List["torch.Tensor"]] = None
