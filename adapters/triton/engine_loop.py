"""The engine side of the Triton model: an `AsyncLLMEngine` on its own event-loop thread.

`submit()` hands a parsed request over and returns at once. Each request is admitted through the engine's
contract (`validate`, `fit_max_tokens` with vLLM's default of 16 new tokens; tokenizing in a worker thread)
and runs as a task on the loop; its responses go through a single sender thread (so Triton's IPC never
stalls the loop), and the last one is always flagged final: after success, errors, cancellation and
shutdown alike. A watcher polls `is_cancelled()` of every live request and aborts cancelled ones in the
engine, which frees their blocks. An engine that cannot continue (`EngineDeadError`) answers UNAVAILABLE
and calls `on_dead` once (the model then unloads itself, so Triton reports it not ready). Triton types
stay out of this file: requests are reached through the `RequestHandle` protocol.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol

import numpy as np

from paged_backend import AsyncLLMEngine, EngineStats, ValidatedRequest
from paged_backend.errors import EngineClosedError, EngineDeadError, InvalidRequest

from .request_inputs import VLLM_DEFAULT_MAX_TOKENS, GenerateRequest
from .response_outputs import StreamState, build_outputs

INVALID_ARG, INTERNAL, CANCELLED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "CANCELLED", "UNAVAILABLE"


@dataclass
class RequestError:
    """An error response: a message for the client and a Triton error code name."""

    message: str
    code: str = INTERNAL


class RequestHandle(Protocol):
    """One Triton request as the service sees it."""

    def is_cancelled(self) -> bool: ...

    def send(self, arrays: Optional[Dict[str, np.ndarray]], error: Optional[RequestError], final: bool) -> None: ...


class Logger(Protocol):
    def log_info(self, message: str) -> None: ...

    def log_error(self, message: str) -> None: ...


class EngineService:
    """Runs `engine` on a private event loop; serves requests, cancellation and stats publishing."""

    def __init__(self, engine: AsyncLLMEngine, logger: Logger,
                 on_stats: Optional[Callable[[EngineStats], None]] = None,
                 cancel_poll_s: float = 0.2, stats_interval_s: float = 0.5,
                 on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        self.engine = engine
        self.logger = logger
        self.on_stats = on_stats
        self.on_dead = on_dead
        self._dead_reported = False
        self.cancel_poll_s = cancel_poll_s
        self.stats_interval_s = stats_interval_s
        self._ids = itertools.count()
        self._active: Dict[str, tuple] = {}  # request id -> (task, handle)
        self._outbox: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._closing = False
        self._was_busy = False
        self._loop_thread = threading.Thread(target=self._run_loop, name="paged-triton-loop", daemon=True)
        self._sender_thread = threading.Thread(target=self._run_sender, name="paged-triton-send", daemon=True)

    # ---- threads -----------------------------------------------------------------------------
    def start(self) -> "EngineService":
        self._sender_thread.start()
        self._loop_thread.start()
        asyncio.run_coroutine_threadsafe(self._start_watchers(), self._loop).result()
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _run_sender(self) -> None:
        while True:
            job = self._outbox.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed send must not stop the others
                self.logger.log_error(f"[paged_backend] sending a response failed: {traceback.format_exc()}")

    async def _start_watchers(self) -> None:
        self._watchers = [asyncio.ensure_future(self._watch_cancellations()),
                          asyncio.ensure_future(self._publish_stats())]

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, handle: RequestHandle, name: str = "") -> str:
        """Start serving `request`; its responses go to `handle`. Returns the engine's request id."""
        request_id = f"triton-{next(self._ids)}" + (f"-{name}" if name else "")
        if self._closing:
            self.send(handle, None, RequestError("the model is shutting down", UNAVAILABLE), True)
            return request_id
        dead = self.engine_dead()
        if dead is not None:
            self.send(handle, None, RequestError(f"the model is unavailable: the engine cannot continue: {dead}",
                                                 UNAVAILABLE), True)
            self._report_dead(dead)
            return request_id
        asyncio.run_coroutine_threadsafe(self._start_request(request_id, request, handle), self._loop)
        return request_id

    def send(self, handle: RequestHandle, arrays: Optional[Dict[str, np.ndarray]],
             error: Optional[RequestError], final: bool) -> None:
        """Queue a response for the sender thread (responses of a request keep their order)."""
        if not self._sender_thread.is_alive():  # after shutdown: answer directly
            handle.send(arrays, error, final)
            return
        self._outbox.put(lambda: handle.send(arrays, error, final))

    async def _start_request(self, request_id: str, request: GenerateRequest, handle: RequestHandle) -> None:
        task = asyncio.ensure_future(self._serve(request_id, request, handle))
        self._active[request_id] = (task, handle)

    def _admit(self, request: GenerateRequest) -> ValidatedRequest:
        """The request checked and prepared once, max_tokens settled (blocking: tokenizes, compiles; runs in a
        worker thread so the loop keeps serving the other streams)."""
        prepared = self.engine.prepare(request.prompt, request.params, request.lora_request)
        return self.engine.fit(prepared, default=VLLM_DEFAULT_MAX_TOKENS)

    def engine_dead(self) -> Optional[BaseException]:
        """Why the engine cannot serve, or None while it can."""
        return self.engine.errored

    def _report_dead(self, exc: BaseException) -> None:
        if not self._dead_reported:
            self._dead_reported = True
            self.logger.log_error(f"[paged_backend] the engine cannot continue: {exc}")
            if self.on_dead is not None:
                self.on_dead(exc)

    async def _serve(self, request_id: str, request: GenerateRequest, handle: RequestHandle) -> None:
        state, loop = StreamState(), asyncio.get_running_loop()
        decode = self.engine.decode_token
        try:
            prepared = await loop.run_in_executor(None, self._admit, request)
            async for output in self.engine.generate(prepared, None, request_id):
                if output.finished and output.error is not None:
                    self.logger.log_error(f"[paged_backend] {request_id} failed: {output.error}")
                    self.send(handle, None, RequestError(f"generation failed: {output.error}", INTERNAL), True)
                    return
                if output.finished and any(c.finish_reason == "abort" for c in output.outputs):
                    raise asyncio.CancelledError()  # aborted in the engine: answered as a cancellation below
                if request.stream or output.finished:
                    self.send(handle, build_outputs(request, output, state, decode), None, output.finished)
                if output.finished:
                    return
            self.send(handle, None, RequestError("the engine returned no final output", INTERNAL), True)
        except asyncio.CancelledError:
            await self.engine.abort(request_id)
            reason = "the model is shutting down" if self._closing else "request was cancelled"
            self.send(handle, None, RequestError(reason, UNAVAILABLE if self._closing else CANCELLED), True)
            self.logger.log_info(f"[paged_backend] {request_id}: {reason}; aborted in the engine")
        except InvalidRequest as exc:
            self.send(handle, None, RequestError(str(exc), INVALID_ARG), True)
        except (EngineDeadError, EngineClosedError) as exc:
            self.send(handle, None, RequestError(f"the model is unavailable: {exc}", UNAVAILABLE), True)
            if isinstance(exc, EngineDeadError):
                self._report_dead(exc)
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self.logger.log_error(f"[paged_backend] {request_id} failed: {traceback.format_exc()}")
            self.send(handle, None, RequestError(f"generation failed: {exc}", INTERNAL), True)
        finally:
            self._active.pop(request_id, None)

    # ---- watchers ----------------------------------------------------------------------------
    async def _watch_cancellations(self) -> None:
        while True:
            await asyncio.sleep(self.cancel_poll_s)
            for request_id, (task, handle) in list(self._active.items()):
                if task.done():
                    continue
                try:
                    cancelled = handle.is_cancelled()
                except Exception:  # noqa: BLE001 - treat an unreachable request as cancelled
                    cancelled = True
                if cancelled:
                    task.cancel()

    async def _publish_stats(self) -> None:
        last: Optional[EngineStats] = None
        while True:
            stats = self.engine.get_stats()
            if stats != last:
                last = stats
                if self.on_stats is not None:
                    self._outbox.put(lambda s=stats: self.on_stats(s))
                self._log_idle(stats)
            await asyncio.sleep(self.stats_interval_s)

    def _log_idle(self, stats: EngineStats) -> None:
        busy = bool(stats.num_running or stats.num_waiting or stats.num_swapped or self._active)
        if self._was_busy and not busy:
            self.logger.log_info(
                f"[paged_backend] engine idle: KV blocks free {stats.num_free_blocks}/{stats.num_blocks}, "
                f"requests finished {stats.num_requests_finished}, failed {stats.num_requests_failed}, "
                f"preemptions {stats.num_preemptions}, generated tokens {stats.num_generated_tokens}")
        self._was_busy = busy

    # ---- shutdown ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight (each gets a final error response), stop the engine and the threads."""
        if self._closing:
            return
        self._closing = True
        if self._loop_thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                future.result(timeout)
            except Exception:  # noqa: BLE001 - keep shutting down
                self.logger.log_error(f"[paged_backend] engine shutdown: {traceback.format_exc()}")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout)
        self._outbox.put(None)
        self._sender_thread.join(timeout)
        if not self._loop_thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        for watcher in getattr(self, "_watchers", []):
            watcher.cancel()
        tasks = [task for task, _ in self._active.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.engine.shutdown()
        if self.on_stats is not None:
            stats = self.engine.get_stats()
            self._outbox.put(lambda: self.on_stats(stats))
