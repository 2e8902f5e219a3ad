"""Streaming without a thread: `model.generate_stream(...)` returns a `GenerationStream` that yields one
`TokenEvent` per generated token of every row, in transformers' step order, and then holds exactly what
`generate` would have returned. Transformers streamers (`TextStreamer`, `TextIteratorStreamer`, any
`BaseStreamer`) are fed from the same steps: `put(prompt ids)` once, `put(step tokens)` per step, `end()`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from paged_backend import IncrementalText

from .attachment import EngineSession
from .outputs import UNMATCHED_ROWS_WARNING
from .runner import Commit, SamplingRun


@dataclass
class TokenEvent:
    """One new token of one output row."""

    row: int                  # row of the output tensor: request * num_return_sequences + sample
    request: int              # row of the input batch
    sample: int               # which of the request's num_return_sequences
    step: int                 # 1 for the first generated token
    token_id: int
    text: str                 # the text this token completes (may be "" inside a multi-byte character)
    finished: bool            # the row ends with this token
    finish_reason: Optional[str] = None   # "stop" (EOS, stop string, stopping criteria) or "length"


def _finish_reason(run: SamplingRun, index: int) -> str:
    row = run.rows[index]
    if row.engine_done and row.finish_reason == "length" and len(row.tokens) == row.stopped_at:
        return "length"
    return "stop"


class GenerationStream:
    """Iterates a sampling/greedy run's tokens; `output` is `generate`'s return value once exhausted."""

    def __init__(self, run: SamplingRun, streamer, tokenizer, session: Callable[[], EngineSession]) -> None:
        self._run, self._streamer, self._session = run, streamer, session
        self._texts = [IncrementalText(tokenizer) for _ in run.rows]
        self._with_events = True
        self._events = self._generate()
        self._output = None
        self._done = False

    def finish(self):
        """Run to the end without building events (what `generate` does); returns `output`."""
        self._with_events = False
        for _ in self._events:
            pass
        return self.output

    @property
    def filled_rows(self) -> bool:
        """Some score/logit rows were left blank (sequences that had finished)."""
        return self._run.filled_rows

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def close(self) -> None:
        """Stop early: aborts the call's requests and frees their KV blocks."""
        self._events.close()

    @property
    def output(self):
        if not self._done:
            raise RuntimeError("the stream is not exhausted yet: iterate it to the end first")
        return self._output

    def _generate(self) -> Iterator[TokenEvent]:
        run, streamer = self._run, self._streamer
        with self._session() as session:  # opened at the first token; closing it aborts what is left
            try:
                if streamer is not None:
                    streamer.put(run.sequences().cpu())
                for commit in run.commits(session):
                    if streamer is not None:
                        streamer.put(torch.tensor(commit.tokens, dtype=torch.long))
                    if self._with_events:
                        yield from self._events_of(commit)
                self._output = run.output()
                self._done = True
                if self._with_events and run.filled_rows and run.plan.options.records:
                    warnings.warn(UNMATCHED_ROWS_WARNING, UserWarning, stacklevel=2)
            finally:
                if streamer is not None:
                    streamer.end()

    def _events_of(self, commit: Commit) -> Iterator[TokenEvent]:
        ended = set(commit.ended)
        per_request = self._run.plan.num_return
        for i, live in enumerate(commit.live):
            if not live:
                continue
            token = commit.tokens[i]
            yield TokenEvent(i, i // per_request, i % per_request, commit.step, token, self._texts[i].push(token),
                             i in ended, _finish_reason(self._run, i) if i in ended else None)
