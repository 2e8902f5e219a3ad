"""What both APIs share: the engine context, prompt limits, per-token updates from cumulative outputs,
cancellation when a client goes away, and a concurrency cap.

The engine streams one cumulative `RequestOutput` per step. `OutputTracker` turns those into per-token
updates (id, text piece, logprob), holding back text that might still turn into a stop string so that
streamed pieces always add up to the final text.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from paged_backend import AsyncLLMEngine, RequestOutput, SamplingParams

from .errors import ClientDisconnected, GenerationFailed, Overloaded, RequestAborted, ValidationFailed
from .metrics import ServerMetrics

T = TypeVar("T")
NEG_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry


@dataclass
class ServerContext:
    """Everything a route needs: the engine, its tokenizer and limits, metrics and the request cap."""

    engine: AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    max_concurrent_requests: int = 512
    in_flight: int = 0
    special_ids: frozenset = field(default_factory=frozenset)
    active_requests: set = field(default_factory=set)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def acquire(self) -> "Slot":
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(self.max_concurrent_requests)
        self.in_flight += 1
        return Slot(self)

    async def abort_all(self) -> int:
        """Abort every engine request in flight (their streams end with an error); returns how many."""
        ids = list(self.active_requests)
        for request_id in ids:
            await self.engine.abort(request_id)
        return len(ids)

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (special tokens spelled out)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class Slot:
    """One admitted request; releasing twice is harmless."""

    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._ctx.in_flight -= 1


# ---- prompt limits ----------------------------------------------------------------------------
def prompt_ids(ctx: ServerContext, prompt) -> List[int]:
    """Token ids of a prompt (text or ids), or ValidationFailed if the engine would refuse it."""
    try:
        return ctx.engine.validate(prompt, SamplingParams())
    except ValueError as exc:
        too_long = "context" in str(exc) or "KV cache" in str(exc)
        code = "context_length_exceeded" if too_long else "invalid_value"
        raise ValidationFailed(str(exc), param="prompt", code=code) from None


def kv_token_limit(ctx: ServerContext, prompt_len: int, branches: int) -> int:
    """The most new tokens each of `branches` sequences can reach while the request runs alone
    (full prompt blocks are shared; each branch needs its own blocks after them)."""
    stats = ctx.engine.get_stats()
    size = stats.block_size
    shared = prompt_len // size
    per_branch = (stats.num_blocks - shared) // max(branches, 1)
    return (shared + per_branch) * size - prompt_len


def max_new_tokens_limit(ctx: ServerContext, prompt_len: int, branches: int) -> int:
    return min(ctx.max_model_len - prompt_len, kv_token_limit(ctx, prompt_len, branches))


def check_max_new_tokens(ctx: ServerContext, prompt_len: int, max_new: int, branches: int, name: str) -> None:
    """ValidationFailed unless `max_new` tokens after the prompt fit the context and the KV cache."""
    if prompt_len + max_new > ctx.max_model_len:
        raise ValidationFailed(
            f"the prompt has {prompt_len} tokens and `{name}` is {max_new}: together they must be <= "
            f"{ctx.max_model_len}, the model's context length", param=name, code="context_length_exceeded")
    limit = kv_token_limit(ctx, prompt_len, branches)
    if max_new > limit:
        stats = ctx.engine.get_stats()
        raise ValidationFailed(
            f"the prompt ({prompt_len} tokens) and `{name}`={max_new} for {branches} sequence(s) do not fit "
            f"in the KV cache ({stats.num_blocks} blocks of {stats.block_size} tokens); at most {limit} new "
            f"tokens fit", param=name, code="kv_cache_exceeded")


# ---- per-token updates --------------------------------------------------------------------------
@dataclass
class TokenInfo:
    """One generated token: id, its piece of the text, logprob, and the top logprobs at its position."""

    id: int
    text: str
    logprob: Optional[float]
    top: Optional[Dict[int, float]] = None


@dataclass
class SequenceUpdate:
    index: int
    tokens: List[TokenInfo]
    text: str
    finish_reason: Optional[str]
    stop_reason: object = None


def finite(value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    return value if math.isfinite(value) else NEG_LOGPROB


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class OutputTracker:
    """Per-sequence deltas between successive cumulative outputs of one request."""

    def __init__(self, hold_back_stops: Sequence[str] = ()) -> None:
        self._stops = list(hold_back_stops)
        self._tokens: Dict[int, int] = {}
        self._chars: Dict[int, int] = {}

    def update(self, output: RequestOutput) -> List[SequenceUpdate]:
        updates = []
        for comp in output.outputs:
            seen_tokens = self._tokens.get(comp.index, 0)
            seen_chars = self._chars.get(comp.index, 0)
            new_ids = comp.token_ids[seen_tokens:]
            done = comp.finish_reason is not None
            visible = len(comp.text) if done else len(comp.text) - _held_back(comp.text, self._stops)
            visible = max(visible, seen_chars)
            text = comp.text[seen_chars:visible]
            if not new_ids and not text and not done:
                continue
            tokens = [self._token(comp, seen_tokens + k, tid) for k, tid in enumerate(new_ids)]
            if tokens:
                tokens[-1].text = text
            self._tokens[comp.index] = len(comp.token_ids)
            self._chars[comp.index] = visible
            updates.append(SequenceUpdate(comp.index, tokens, text, comp.finish_reason, comp.stop_reason))
        return updates

    @staticmethod
    def _token(comp, position: int, token_id: int) -> TokenInfo:
        top = comp.logprobs[position] if comp.logprobs is not None and position < len(comp.logprobs) else None
        logprob = top.get(token_id) if top else None
        return TokenInfo(token_id, "", finite(logprob), top)


# ---- running requests ---------------------------------------------------------------------------
async def request_outputs(ctx: ServerContext, prompt: List[int], params: SamplingParams,
                          request_id: str) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request; aborts it if the consumer stops early (disconnect, cancel)."""
    stream = ctx.engine.generate(prompt, params, request_id)
    finished = False
    ctx.active_requests.add(request_id)
    async with contextlib.aclosing(stream):
        try:
            async for output in stream:
                if output.finished:
                    finished = True
                    ctx.metrics.observe_finished(output)
                    if output.error is not None:
                        raise GenerationFailed(output.error)
                    if any(c.finish_reason == "abort" for c in output.outputs):
                        raise RequestAborted()
                yield output
        except ValueError as exc:  # refused by the engine after our own checks passed
            raise ValidationFailed(str(exc)) from None
        except RuntimeError as exc:
            raise GenerationFailed(str(exc)) from None
        finally:
            ctx.active_requests.discard(request_id)
            if not finished:
                ctx.metrics.observe_aborted()


async def final_output(ctx: ServerContext, prompt: List[int], params: SamplingParams, request_id: str,
                       tracker: Optional[OutputTracker] = None,
                       tokens: Optional[Dict[int, List[TokenInfo]]] = None) -> RequestOutput:
    """Run a request to the end; with a tracker, collect each sequence's tokens into `tokens`."""
    last = None
    async for output in request_outputs(ctx, prompt, params, request_id):
        if tracker is not None:
            for update in tracker.update(output):
                tokens.setdefault(update.index, []).extend(update.tokens)
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
