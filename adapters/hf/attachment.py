"""The state an attached model carries: its engine and tokenizer, shared by every generate call on it.

Calls do not wait for each other: each call opens an `EngineSession`, adds its requests to the one engine and
steps it; the outputs of a step go to the session that owns each request (continuous batching across calls
and threads), and a lock is held only around one engine operation, never across a whole call. So an
unfinished `generate_stream` in one thread (or in the same one) does not block a `generate` elsewhere.
While any call runs, the model is in eval mode (the engine needs dropout off); the training flags of its
modules are restored as they were when the last call ends.
"""

from __future__ import annotations

import itertools
import threading
from typing import Dict, List, Optional

import torch

from paged_backend import LLMEngine, RequestOutput, SamplingParams

from .peft_adapters import adapter_cache_salt

STATE = "_paged_backend_attachment"


def training_flags(model: torch.nn.Module) -> Dict[torch.nn.Module, bool]:
    """Each module's `training` flag (to restore exactly, mixed modes included)."""
    return {module: module.training for module in model.modules()}


def restore_training(flags: Dict[torch.nn.Module, bool]) -> None:
    for module, training in flags.items():
        module.training = training


class Attachment:
    """The engine of one attached model, the sessions of the calls running on it, and their outputs."""

    def __init__(self, model: torch.nn.Module, engine: LLMEngine, tokenizer) -> None:
        self.model = model
        self.engine: Optional[LLMEngine] = engine
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._inboxes: Dict[str, List[RequestOutput]] = {}  # request id -> outputs not yet read by its session
        self._sessions = 0
        self._training: Optional[Dict[torch.nn.Module, bool]] = None  # flags to restore when no call runs
        self._ids = itertools.count()
        self._engine_speculation = engine.config.speculative   # the engine's own (attach's speculative_config)
        self._base_speculation = self._engine_speculation
        self._speculating: List[dict] = []   # the speculation of running calls that asked for one, in order

    def running_engine(self) -> LLMEngine:
        engine = self.engine
        if engine is None:
            raise RuntimeError("the model was detached from the paged backend")
        return engine

    def session(self, speculation: Optional[dict] = None) -> "EngineSession":
        """A new call's view of the engine (use it as a context manager); `speculation`: the engine's
        speculative_config while the call runs (transformers' assisted generation)."""
        return EngineSession(self, f"hf-{next(self._ids)}-", speculation)

    # ---- used by sessions, under the lock ---------------------------------------------------------
    def _open(self, speculation: Optional[dict] = None) -> None:
        with self._lock:
            engine = self.running_engine()
            if speculation is not None:
                engine.set_speculative_config(speculation)   # refused (ValueError) before anything changes
                if not self._speculating:
                    self._base_speculation = self._engine_speculation
                self._speculating.append(speculation)
            if self._sessions == 0:
                self._training = training_flags(self.model)
                self.model.eval()
            self._sessions += 1

    def _end_speculation(self, speculation: Optional[dict]) -> None:
        """A call that asked for speculation ends: the engine goes back to the speculation of the calls still
        running that asked for one (the latest), or to its own. Greedy outputs never depend on it."""
        if speculation is None:
            return
        self._speculating.remove(speculation)
        if self.engine is not None:
            self.engine.set_speculative_config(self._speculating[-1] if self._speculating
                                               else self._base_speculation)

    def _close(self, request_ids: List[str], speculation: Optional[dict] = None) -> None:
        with self._lock:
            self._end_speculation(speculation)
            unfinished = [rid for rid in request_ids if rid in self._inboxes]
            if unfinished and self.engine is not None:
                self.engine.abort_request(unfinished)
            for rid in request_ids:
                self._inboxes.pop(rid, None)
            self._sessions -= 1
            if self._sessions == 0 and self._training is not None:
                restore_training(self._training)
                self._training = None

    def _add(self, request_id: str, prompt, params: SamplingParams, cache_salt: Optional[str] = None) -> None:
        with self._lock:
            engine = self.running_engine()
            engine.add_request(request_id, engine.prepare_request(prompt, params, cache_salt=cache_salt))
            self._inboxes[request_id] = []

    def _abort(self, request_ids: List[str]) -> None:
        with self._lock:
            live = [rid for rid in request_ids if rid in self._inboxes]
            self.running_engine().abort_request(live)
            for rid in live:
                self._inboxes.pop(rid)

    def _outputs(self, request_ids: List[str]) -> List[RequestOutput]:
        """The outputs waiting for `request_ids`; when none waits, one engine step is run first (its outputs
        for other sessions' requests wait in their inboxes)."""
        with self._lock:
            engine = self.running_engine()
            mine = self._take(request_ids)
            if mine or not any(rid in self._inboxes for rid in request_ids):
                return mine
            for output in engine.step():
                inbox = self._inboxes.get(output.request_id)
                if inbox is not None:
                    inbox.append(output)
            return self._take(request_ids)

    def _take(self, request_ids: List[str]) -> List[RequestOutput]:
        taken = []
        for rid in request_ids:
            inbox = self._inboxes.get(rid)
            if inbox:
                taken += inbox
                inbox.clear()
                if taken[-1].finished:
                    del self._inboxes[rid]
        return taken

    def detach(self) -> LLMEngine:
        """Stop serving: later engine operations of open sessions raise; the training flags are restored."""
        with self._lock:
            engine = self.running_engine()
            self.engine = None
            self._inboxes.clear()
            if self._training is not None:
                restore_training(self._training)
                self._training = None
            return engine


class EngineSession:
    """One generate call's requests in the shared engine: add them, read their outputs, abort them; closing
    the session aborts what is still running and frees its blocks."""

    def __init__(self, attachment: Attachment, prefix: str, speculation: Optional[dict] = None) -> None:
        self._attachment = attachment
        self._prefix = prefix
        self._speculation = speculation
        self.request_ids: List[str] = []
        # the PEFT adapters active when the call starts: its requests' KV is cached under their name only
        self.cache_salt: Optional[str] = adapter_cache_salt(attachment.model)

    def __enter__(self) -> "EngineSession":
        self._attachment._open(self._speculation)
        return self

    def __exit__(self, *exc) -> None:
        self._attachment._close(self.request_ids, self._speculation)

    def add(self, key: int, prompt, params: SamplingParams) -> str:
        """Queue one request of this call; returns its engine request id."""
        request_id = self._prefix + str(key)
        self._attachment._add(request_id, prompt, params, self.cache_salt)
        self.request_ids.append(request_id)
        return request_id

    def outputs(self) -> List[RequestOutput]:
        """The next outputs of this call's requests (after at most one engine step)."""
        return self._attachment._outputs(self.request_ids)

    def abort(self, request_ids: List[str]) -> None:
        self._attachment._abort(request_ids)


def attachment_of(model) -> Attachment:
    state = model.__dict__.get(STATE)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not attached to the paged backend: call attach(model) first")
    return state


def is_attached(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get(STATE), Attachment)
