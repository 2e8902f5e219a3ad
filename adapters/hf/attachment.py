"""The state an attached model carries: its engine, its tokenizer, and the lock that serializes its calls."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from paged_backend import LLMEngine

STATE = "_paged_backend_attachment"


class Attachment:
    """The engine of one attached model and the lock that serializes its generate calls."""

    def __init__(self, engine: LLMEngine, tokenizer) -> None:
        self.engine: Optional[LLMEngine] = engine
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._owner: Optional[int] = None

    @contextmanager
    def guard(self) -> Iterator[LLMEngine]:
        if self._owner == threading.get_ident():
            raise RuntimeError("a generate call on this model is still running in this thread (an unfinished "
                               "generate_stream?): exhaust or close() it first")
        with self._lock:
            if self.engine is None:
                raise RuntimeError("the model was detached from the paged backend")
            self._owner = threading.get_ident()
            try:
                yield self.engine
            finally:
                self._owner = None


def attachment_of(model) -> Attachment:
    state = model.__dict__.get(STATE)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not attached to the paged backend: call attach(model) first")
    return state


def is_attached(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get(STATE), Attachment)
