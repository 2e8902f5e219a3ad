"""`AsyncLLMEngine`: the engine behind an asyncio server, one stream of outputs per request.

Steps run in a worker thread, so the event loop stays responsive; requests added or aborted while a
step runs are applied between steps. The loop task exists only while there is work. A request that
fails ends its own stream with the error in its final output; an engine that cannot continue sets
`errored` (servers report themselves unhealthy) and ends every stream with an `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple, Union

import torch

from paged_backend.engine.llm_engine import LLMEngine, PromptType
from paged_backend.engine.lora_request import LoRARequest
from paged_backend.errors import EngineClosedError, EngineDeadError
from paged_backend.engine.metrics import EngineStats
from paged_backend.engine.outputs import RequestOutput
from paged_backend.engine.request_intake import ValidatedRequest
from paged_backend.sampling_params import SamplingParams
from paged_backend.worker import compute_thread

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Streams cumulative `RequestOutput`s per request; aborting or cancelling frees its blocks."""

    def __init__(self, model: Union[str, torch.nn.Module] = "smollm2", tokenizer=None,
                 dtype: Union[torch.dtype, str, None] = None, device: Union[str, torch.device] = "cpu",
                 **engine_options) -> None:
        # built on the compute thread, where its torch work runs (compute_thread.py)
        self._init(compute_thread.run_on_compute_thread(LLMEngine, model, tokenizer=tokenizer, dtype=dtype,
                                                        device=device, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "AsyncLLMEngine":
        self = cls.__new__(cls)
        self._init(engine)
        return self

    def _init(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: Dict[str, asyncio.Queue] = {}
        self._pending_adds: List[Tuple[str, ValidatedRequest]] = []
        self._pending_aborts: List[str] = []
        self._task: Optional[asyncio.Task] = None
        # an overlapped engine's step hands its forward to the compute thread, so it runs in a thread of its own;
        # an engine without overlap runs the forward inside step(), so step() runs on the compute thread
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-step") \
            if engine.overlapped else None
        self._ids = itertools.count()
        self._stats = engine.get_stats()
        self._closed = False
        self.errored: Optional[BaseException] = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def decode_token(self, token_id: int) -> str:
        """`LLMEngine.decode_token`: one token's text, special tokens spelled out."""
        return self.engine.decode_token(token_id)

    @property
    def max_model_len(self) -> int:
        """The context limit in tokens (prompt and output together)."""
        return self.engine.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """Text prompts longer than this are refused without tokenizing (`LLMEngine.max_prompt_chars`)."""
        return self.engine.max_prompt_chars

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def get_stats(self) -> EngineStats:
        """The statistics as of the last step (safe to call while a step runs)."""
        return self._stats

    def validate(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """Token ids of a prompt, or an `InvalidRequest` for input the engine would refuse (see
        `LLMEngine.validate_request`; safe to call from any thread)."""
        return self.engine.validate_request(prompt, params)

    def encode(self, prompt: PromptType, truncate: Optional[int] = None, add_special_tokens: bool = True) -> List[int]:
        """Token ids of a prompt, validated (`LLMEngine.encode`; blocking)."""
        return self.engine.encode(prompt, truncate, add_special_tokens)

    def prepare(self, prompt: PromptType, params: SamplingParams, lora_request: Optional[LoRARequest] = None,
                cache_salt: Optional[str] = None) -> ValidatedRequest:
        """A checked and prepared request for `generate` (`LLMEngine.prepare_request`; blocking: tokenizes,
        compiles and reads the adapter, so servers call it in a worker thread)."""
        return self.engine.prepare_request(prompt, params, lora_request, cache_salt)

    def prepare_many(self, prompts: Sequence[PromptType], params: SamplingParams,
                     lora_request: Optional[LoRARequest] = None,
                     cache_salt: Optional[str] = None) -> List[ValidatedRequest]:
        """Several prompts with the same params (`LLMEngine.prepare_requests`; blocking)."""
        return self.engine.prepare_requests(prompts, params, lora_request, cache_salt)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on the compute thread (`LLMEngine.add_lora`); False if already loaded."""
        return await asyncio.wrap_future(compute_thread.submit(self.engine.add_lora, lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """`LLMEngine.remove_lora` (requests still running with the adapter finish with it)."""
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> List[int]:
        """`LLMEngine.list_loras`."""
        return self.engine.list_loras()

    @property
    def lora_enabled(self) -> bool:
        """Whether requests may name LoRA adapters (`enable_lora`)."""
        return self.engine.lora_enabled

    def max_new_tokens(self, prompt_len: int, num_branches: int = 1) -> int:
        """How many new tokens a prompt can still get (`LLMEngine.max_new_tokens`)."""
        return self.engine.max_new_tokens(prompt_len, num_branches)

    def fit_max_tokens(self, prompt_len: int, params: SamplingParams, default: Optional[int] = None,
                       param: str = "max_tokens") -> SamplingParams:
        """`params` with max_tokens settled and checked (`LLMEngine.fit_max_tokens`)."""
        return self.engine.fit_max_tokens(prompt_len, params, default, param)

    def fit(self, request: ValidatedRequest, default: Optional[int] = None,
            param: str = "max_tokens") -> ValidatedRequest:
        """A prepared request with max_tokens settled and checked (`LLMEngine.fit_request`)."""
        return self.engine.fit_request(request, default, param)

    async def generate(self, prompt: Union[PromptType, ValidatedRequest], params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step it takes part in; the last one is finished. `prompt` is a
        prompt (with `params`; checked in a worker thread, never on the event loop) or a `ValidatedRequest`
        from `prepare` (queued as it is, with the adapter it was prepared with)."""
        self._check_open()
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        if isinstance(prompt, ValidatedRequest):
            if params is not None or lora_request is not None:
                raise ValueError("a prepared request carries its own params and lora_request; pass neither")
            request = prompt
        else:
            params = SamplingParams() if params is None else params
            request = await asyncio.get_running_loop().run_in_executor(None, self.prepare, prompt, params,
                                                                       lora_request)
            self._check_open()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._pending_adds.append((request_id, request))
        self._start()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)
            self._streams.pop(request_id, None)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        if self.errored is not None:
            raise EngineDeadError(f"the engine cannot take requests: {self.errored}")

    async def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step."""
        if any(r == request_id for r, _ in self._pending_adds):
            self._pending_adds = [p for p in self._pending_adds if p[0] != request_id]
            self._stats = self.engine.get_stats() if self._task is None else self._stats
            return
        self._pending_aborts.append(request_id)
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put_nowait(output)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request_id, request in adds:
            try:
                self.engine.add_request(request_id, request)
            except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait(exc)
        aborts, self._pending_aborts = self._pending_aborts, []
        for output in self.engine.abort_request(aborts):
            self._deliver(output)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.get_stats()
                if not self._pending_adds and not self._pending_aborts:
                    return
                continue
            try:
                outputs = await (loop.run_in_executor(self._executor, self.engine.step) if self._executor is not None
                                 else asyncio.wrap_future(compute_thread.submit(self.engine.step)))
            except Exception as exc:  # noqa: BLE001 - per-request failures come back as outputs; this is fatal
                self._die(exc)
                return
            self._stats = self.engine.get_stats()
            for output in outputs:
                self._deliver(output)

    def _die(self, exc: Exception) -> None:
        """The engine cannot step any more: mark it errored and end every stream with the error."""
        self.errored = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine step raised {type(exc).__name__}: {exc}")
        if not isinstance(exc, EngineDeadError):
            logger.error("the engine step raised; the engine is marked as failed", exc_info=exc)
        self.engine.abort_request(list(self.engine.groups))
        self._pending_adds.clear()
        self._pending_aborts.clear()
        for stream in self._streams.values():
            stream.put_nowait(self.errored)
        self._stats = self.engine.get_stats()

    async def wait_idle(self) -> None:
        """Wait until the background loop has nothing left to do."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def shutdown(self) -> None:
        """Abort everything in flight, free its blocks and stop the worker thread."""
        self._closed = True
        for request_id in list(self._streams):
            await self.abort(request_id)
        await self.wait_idle()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.engine.shutdown()
