"""Engine outputs -> the arrays of one Triton response (`text_output`, `finish_reason`, ...).

Streaming sends only what is new since the last response of the request, per sequence. Text that a
stop string might still cut off is held back until it is settled, and beam search (whose best beams are
known only at the end) sends its sequences with the final response, so the streamed pieces always
concatenate to the final text. No Triton import here: model.py wraps the arrays into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np

from paged_backend import CompletionOutput, RequestOutput, SamplingParams

from .params import GenerateRequest


@dataclass
class StreamState:
    """What a request has already sent: characters of text and token counts per sequence."""

    sent_chars: List[int] = field(default_factory=list)
    sent_tokens: List[int] = field(default_factory=list)
    prompt_sent: bool = False


def settled_text(completion: CompletionOutput, params: SamplingParams, finished: bool) -> str:
    """The part of a sequence's text that no later step can change."""
    if finished or completion.finish_reason is not None:
        return completion.text
    if params.use_beam_search:
        return ""
    if params.stop_strings and not params.include_stop_str_in_output:
        hold = max(len(s) for s in params.stop_strings) - 1
        return completion.text[: max(len(completion.text) - hold, 0)]
    return completion.text


def settled_tokens(completion: CompletionOutput, params: SamplingParams, finished: bool) -> int:
    if params.use_beam_search and not finished:
        return 0
    return len(completion.token_ids)


def build_outputs(request: GenerateRequest, output: RequestOutput, state: StreamState) -> Dict[str, np.ndarray]:
    """The response arrays for `output`, advancing `state` (a fresh state gives the whole text)."""
    params = request.params
    completions = output.outputs
    while len(state.sent_chars) < len(completions):
        state.sent_chars.append(0)
        state.sent_tokens.append(0)
    prefix = ""
    if request.prepend_input and not state.prompt_sent:
        prefix = output.prompt if output.prompt is not None else request.prompt
    state.prompt_sent = True
    texts, new_tokens = [], []
    for i, completion in enumerate(completions):
        text = settled_text(completion, params, output.finished)
        texts.append((prefix + text[state.sent_chars[i]:]).encode("utf-8"))
        state.sent_chars[i] = max(state.sent_chars[i], len(text))
        count = settled_tokens(completion, params, output.finished)
        new_tokens.append(max(count - state.sent_tokens[i], 0))
        state.sent_tokens[i] = max(state.sent_tokens[i], count)
    arrays: Dict[str, np.ndarray] = {"text_output": np.array(texts, dtype=np.object_)}
    if request.return_finish_reason:
        arrays["finish_reason"] = np.array([str(c.finish_reason).encode("utf-8") for c in completions],
                                           dtype=np.object_)
    if request.return_cumulative_logprob:
        arrays["cumulative_logprob"] = np.array([c.cumulative_logprob for c in completions], dtype=np.float32)
    if request.return_num_input_tokens:
        arrays["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
    if request.return_num_output_tokens:
        arrays["num_output_tokens"] = np.array(new_tokens, dtype=np.uint32)
    return arrays
