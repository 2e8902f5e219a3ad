"""Running engine requests for a route: per-token views of the engine's (delta) outputs, aborting a
request when its client goes away, merging several requests' streams, and streaming responses that
always close what they stream.

The engine does the streaming work itself (`RequestOutputKind.DELTA`: new tokens and text per step, stop
strings held back); routes only shape what it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from paged_backend import CompletionOutput, RequestOutput, ValidatedRequest
from paged_backend.errors import EngineClosedError, EngineDeadError, InvalidRequest

from .context import ServerContext
from .errors import ClientDisconnected, GenerationFailed, RequestAborted, refusal

T = TypeVar("T")
NEG_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry
logger = logging.getLogger("paged_backend.http")


@dataclass
class TokenInfo:
    """One generated token: id, its piece of the text, logprob, and the top logprobs at its position."""

    id: int
    text: str
    logprob: Optional[float]
    top: Optional[Dict[int, float]] = None


def sse_event(payload, prefix: str = "data: ") -> str:
    """One server-sent event carrying `payload` as JSON (OpenAI writes `data: `, TGI `data:`)."""
    return prefix + json.dumps(payload, ensure_ascii=False) + "\n\n"


def finite(value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    return value if math.isfinite(value) else NEG_LOGPROB


def token_infos(comp: CompletionOutput) -> List[TokenInfo]:
    """The tokens of a completion (or of a delta); the completion's text is the piece of its last token."""
    infos = []
    for k, token_id in enumerate(comp.token_ids):
        top = comp.logprobs[k] if comp.logprobs is not None and k < len(comp.logprobs) else None
        infos.append(TokenInfo(token_id, "", finite(top.get(token_id)) if top else None, top))
    if infos:
        infos[-1].text = comp.text
    return infos


# ---- running requests ---------------------------------------------------------------------------
async def request_outputs(ctx: ServerContext, request: ValidatedRequest,
                          request_id: str) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one prepared request (as its `output_kind` asks; it was validated once, in a
    worker thread); aborts it if the consumer stops early (disconnect, cancel). A failed or aborted request
    raises the matching APIError."""
    stream = ctx.engine.generate(request, None, request_id)
    ctx.active_requests.add(request_id)
    async with contextlib.aclosing(stream):
        try:
            async for output in stream:
                if output.finished and output.error is not None:
                    logger.warning("request %s failed: %s", request_id, output.error)
                    raise GenerationFailed(output.error)
                if output.finished and any(c.finish_reason == "abort" for c in output.outputs):
                    raise RequestAborted()
                yield output
        except InvalidRequest as exc:  # refused by the engine after the route's own checks passed
            raise refusal(exc) from None
        except EngineClosedError:
            raise RequestAborted() from None
        except EngineDeadError as exc:
            logger.error("request %s failed: the engine cannot continue: %s", request_id, exc)
            raise GenerationFailed(f"the engine cannot serve requests: {exc}") from None
        finally:
            ctx.active_requests.discard(request_id)


async def final_output(ctx: ServerContext, request: ValidatedRequest, request_id: str) -> RequestOutput:
    """Run a request (cumulative outputs) to the end; its final output."""
    last = None
    async for output in request_outputs(ctx, request, request_id):
        last = output
    return last


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending


async def merge(streams: List[AsyncIterator[T]]) -> AsyncIterator[tuple]:
    """(stream index, item) from several async iterators as items arrive; closes them all at the end."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((i, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            await queue.put((i, None, exc))
            return
        await queue.put((i, None, StopAsyncIteration()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if isinstance(exc, StopAsyncIteration):
                remaining -= 1
            elif exc is not None:
                raise exc
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always closes its body iterator (aborting the engine request) and runs
    `on_close`, whether the stream ended, the client disconnected or the server is shutting down."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()
