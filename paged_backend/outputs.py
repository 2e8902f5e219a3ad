"""What the engine returns per request: `RequestOutput` holding one `CompletionOutput` per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


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
