"""Streaming pieces for every front: delta outputs and incremental text.

`DeltaTracker` turns a request's cumulative `RequestOutput`s into deltas (`SamplingParams(output_kind=
RequestOutputKind.DELTA)`): per sequence the tokens, logprobs and text added since the last output. Text
that a stop string could still cut off is held back until it is settled, and requests whose returned
sequences are only known at the end (beam search, `best_of > n`) report everything with their final
output, so the pieces of a sequence always concatenate to its final text.

`IncrementalText` gives the text each new token adds to a growing list of token ids (used where the engine
runs without detokenizing, as the Hugging Face front does).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

from paged_backend.engine.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling_params import SamplingParams


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is the start of one of `stops` (a stop string that the
    next tokens could still complete, which would cut the text there)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass
class _Sent:
    """What one sequence has reported so far."""

    tokens: int = 0
    chars: int = 0
    finished: bool = False


class DeltaTracker:
    """Deltas between successive cumulative outputs of one request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._sent: Dict[int, _Sent] = {}

    @property
    def _hold_all(self) -> bool:
        """The returned sequences are only known once the request ends."""
        return self.params.use_beam_search or self.params.best_of > self.params.n

    @property
    def _stops(self) -> List[str]:
        return [] if self.params.include_stop_str_in_output else self.params.stop_strings

    def update(self, output: RequestOutput) -> Optional[RequestOutput]:
        """The delta of `output`, or None when there is nothing new to report."""
        if self._hold_all and not output.finished:
            return None
        deltas = [d for d in (self._delta(c, output.finished) for c in output.outputs) if d is not None]
        if not deltas and not output.finished:
            return None
        return replace(output, outputs=deltas, step_scores=None, step_logits=None)

    def _delta(self, comp: CompletionOutput, request_done: bool) -> Optional[CompletionOutput]:
        sent = self._sent.setdefault(comp.index, _Sent())
        done = comp.finish_reason is not None or request_done
        visible = len(comp.text) if done else len(comp.text) - held_back(comp.text, self._stops)
        visible = max(visible, sent.chars)
        new_ids = comp.token_ids[sent.tokens:]
        text = comp.text[sent.chars:visible]
        if not new_ids and not text and (sent.finished or comp.finish_reason is None):
            return None
        start = sent.tokens
        sent.tokens, sent.chars = len(comp.token_ids), visible
        sent.finished = sent.finished or comp.finish_reason is not None
        return replace(comp, text=text, token_ids=list(new_ids),
                       logprobs=None if comp.logprobs is None else comp.logprobs[start:],
                       scores=None if comp.scores is None else comp.scores[start:],
                       logits=None if comp.logits is None else comp.logits[start:])


class IncrementalText:
    """Text deltas of a growing token list, decoding only the last few tokens each time."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.tokens: List[int] = []
        self.prefix_offset = 0   # decoding starts here, so merges and spaces come out right
        self.read_offset = 0     # text up to here has been returned

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" inside a multi-byte character)."""
        self.tokens.append(token_id)
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        text = decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # no visible text yet, or an incomplete UTF-8 character: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(prefix):]
