"""Engine outputs -> the arrays of one Triton response, one element per returned sequence, as Triton's vLLM
backend shapes them: `text_output`, `finish_reason`, `cumulative_logprob`, `logprobs`, `num_input_tokens`,
`num_output_tokens`.

Streaming requests get the engine's deltas (`RequestOutputKind.DELTA`: per sequence the new tokens and the
settled text, stop strings held back, beams only at the end); others get only the final output. A delta
may leave out a sequence that has nothing new: it answers "" and 0 new tokens, its last finish reason and
cumulative logprob. No Triton import here: model.py wraps the arrays into tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from paged_backend import CompletionOutput, RequestOutput, ranked_logprobs

from .request_inputs import GenerateRequest

DecodeToken = Callable[[int], str]


@dataclass
class StreamState:
    """What earlier responses of a request reported, per sequence."""

    finish: Dict[int, Optional[str]] = field(default_factory=dict)
    cumulative: Dict[int, float] = field(default_factory=dict)
    prompt_sent: bool = False


def _logprob_entries(comp: CompletionOutput, decode_token: DecodeToken) -> List[dict]:
    """vLLM's logprobs of each new token: {token id: {"logprob", "rank", "decoded_token"}}, with the engine's
    rank of each (1 = most likely; the sampled token's true rank when it is outside the top k)."""
    return [{str(tid): {"logprob": float(lp) if np.isfinite(lp) else None, "rank": getattr(lp, "rank", None),
                        "decoded_token": decode_token(tid)} for tid, lp in ranked_logprobs(top)}
            for top in comp.logprobs or []]


def build_outputs(request: GenerateRequest, output: RequestOutput, state: StreamState,
                  decode_token: Optional[DecodeToken] = None) -> Dict[str, np.ndarray]:
    """The response arrays for `output` (a delta when streaming, else the final output), advancing `state`."""
    params = request.params
    by_index = {c.index: c for c in output.outputs}
    count = max([params.n, len(output.outputs)] + [i + 1 for i in by_index])
    prefix = ""
    if request.prepend_input and not state.prompt_sent:
        prefix = output.prompt if output.prompt is not None else request.prompt
    state.prompt_sent = True
    texts, new_tokens, logprobs = [], [], []
    for i in range(count):
        comp = by_index.get(i)
        if comp is not None:
            state.finish[i] = comp.finish_reason
            state.cumulative[i] = comp.cumulative_logprob
        texts.append((prefix + (comp.text if comp else "")).encode("utf-8"))
        new_tokens.append(len(comp.token_ids) if comp else 0)
        if request.return_logprobs:
            entries = None if not request.logprobs_requested else (
                _logprob_entries(comp, decode_token or str) if comp else [])
            logprobs.append(json.dumps(entries).encode("utf-8"))
    arrays: Dict[str, np.ndarray] = {"text_output": np.array(texts, dtype=np.object_)}
    if request.return_finish_reason:
        arrays["finish_reason"] = np.array([str(state.finish.get(i)).encode("utf-8") for i in range(count)],
                                           dtype=np.object_)
    if request.return_cumulative_logprob:
        arrays["cumulative_logprob"] = np.array([state.cumulative.get(i, 0.0) for i in range(count)], dtype=np.float32)
    if request.return_logprobs:
        arrays["logprobs"] = np.array(logprobs, dtype=np.object_)
    if request.return_num_input_tokens:
        arrays["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
    if request.return_num_output_tokens:
        arrays["num_output_tokens"] = np.array(new_tokens, dtype=np.uint32)
    if request.batched:  # the request had a batch dimension (of 1): so do its outputs
        arrays = {name: array.reshape(1, -1) for name, array in arrays.items()}
    return arrays
