"""What every route needs: the engine, its tokenizer, the request cap, and a thread pool for the blocking
work of a request (parsing large bodies, tokenizing, chat templates) so the event loop stays responsive."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Type, TypeVar

from fastapi import Request
from pydantic import BaseModel

from paged_backend import AsyncLLMEngine

from .body import decode_body
from .errors import Overloaded
from .loras import ServedAdapters
from .metrics import ServerMetrics

T = TypeVar("T")
Model = TypeVar("Model", bound=BaseModel)


@dataclass
class ServerContext:
    """The engine and what the routes share; one per app."""

    engine: AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    max_concurrent_requests: int = 512
    in_flight: int = 0
    special_ids: frozenset = field(default_factory=frozenset)
    active_requests: set = field(default_factory=set)
    validation_workers: int = 2  # threads that parse, tokenize and validate requests (TGI's --validation-workers)
    workers: Optional[concurrent.futures.ThreadPoolExecutor] = None
    loras: Optional[ServedAdapters] = None   # the LoRA adapters requests may name (loras.py)

    def __post_init__(self) -> None:
        if self.loras is None:
            self.loras = ServedAdapters(self.model_name)
        if self.workers is None:
            self.workers = concurrent.futures.ThreadPoolExecutor(max_workers=self.validation_workers,
                                                                 thread_name_prefix="paged-http")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def acquire(self) -> "Slot":
        """A place among the requests in flight, or Overloaded (429)."""
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(self.max_concurrent_requests)
        self.in_flight += 1
        return Slot(self)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the worker threads (tokenizing, parsing) and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(fn, *args))

    async def read(self, request: Request, model: Type[Model]) -> Model:
        """The request's body parsed and validated as `model`, off the event loop."""
        raw = await request.body()
        return await self.blocking(decode_body, raw, model)

    async def abort_all(self) -> int:
        """Abort every engine request in flight (their streams end with an error); returns how many."""
        ids = list(self.active_requests)
        for request_id in ids:
            await self.engine.abort(request_id)
        return len(ids)

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (special tokens spelled out)."""
        return self.engine.decode_token(token_id)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)


def context_of(request) -> "ServerContext":
    """The server context of the app a request reached."""
    return request.app.state.ctx


class Slot:
    """One admitted request; releasing twice is harmless."""

    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._ctx.in_flight -= 1
