"""What the engine returns per request: `RequestOutput` holding one `CompletionOutput` per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a sample or a beam)."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: float
    logprobs: Optional[List[Dict[int, float]]] = None
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
