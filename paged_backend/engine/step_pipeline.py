"""Launched steps and the worker that runs them.

A launched step carries what the scheduler decided, its inputs and a future of its results: the forward and the
sampler's draws (`StepResult`). With overlapped scheduling (`async_scheduling`) one worker thread runs the steps
in launch order, so the engine schedules step N+1 and prepares its inputs while step N's forward runs, and
processes step N's tokens while step N+1's runs; a decode row of step N+1 whose input token step N is still
sampling gets it from step N's sampled tokens by index (`TokenFill`), in the worker, just before the forward.
When step N+1 is launched before step N's job ends, step N's results reach the engine's thread only once step
N+1's forward is on its way (the runner's `on_launched`): the engine's processing then runs while the device
works, instead of holding the interpreter while the worker still prepares that forward. Without overlap a step
runs inline, as soon as it is launched.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch

from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import SequenceGroup
from paged_backend.worker import compute_thread
from paged_backend.engine.input_builder import TokenFill
from paged_backend.engine.token_processor import StepRows
from paged_backend.sampling.sampler import PendingDraws, SampleBatch
from paged_backend.worker.step_inputs import DeviceFill, StepInputs


@dataclass
class StepResult:
    """What a step's forward and sampling produced (the sampler's error, if its batched stage raised)."""

    logits: Optional[torch.Tensor]
    batch: Optional[SampleBatch] = None
    sample_error: Optional[BaseException] = None
    pending: Optional[PendingDraws] = None   # one-token draws still on their way to the host (`settle`)

    def settle(self) -> None:
        """The pending tokens' batch, once they reach the host (the engine's thread waits for them here); an
        error surfacing there is the sampler's. `pending` stays: the next step's job may read its tokens from
        another thread meanwhile (`LaunchedStep.sampled_tokens`)."""
        pending = self.pending
        if pending is not None and self.batch is None and self.sample_error is None:
            try:
                self.batch = pending.batch()
            except Exception as exc:  # noqa: BLE001 - the step's sampled rows fail, as a failed sampler's
                self.sample_error = exc


@dataclass
class LaunchedStep:
    """One step on its way: the scheduler's decision, its rows, the running requests when it was scheduled (a
    failed forward fails them), its inputs and the future of its results."""

    sched: SchedulerOutput
    rows: StepRows
    running: List[SequenceGroup]
    inputs: StepInputs
    fill: Optional[TokenFill] = None
    filled: bool = False                    # its pending input ids hold the previous step's tokens (worker side)
    successor: Optional["LaunchedStep"] = None   # the step launched after it (fills its inputs, releases our results)
    lora_slot_of: Dict[int, int] = field(default_factory=dict)   # lora_int_id -> the device slot it runs in
    future: Optional[concurrent.futures.Future] = None   # the worker's job (its result, or how it failed)
    results: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)   # what the engine waits for
    _held: Optional[StepResult] = field(default=None, repr=False)
    _rows_of: Optional[Dict[int, int]] = field(default=None, repr=False)

    @property
    def overlappable(self) -> bool:
        """The next step may be scheduled before this one is processed."""
        return not self.rows.needs_processing

    def loaded_slots(self) -> Set[int]:
        """The LoRA slots this step loads before its forward."""
        return set(self.inputs.lora.loads) if self.inputs.lora is not None else set()

    def lora_slot(self, group: SequenceGroup) -> Optional[int]:
        """The device slot of a request's adapter in this step (None: the base model)."""
        request = group.lora_request
        return None if request is None else self.lora_slot_of.get(request.lora_int_id)

    def sample_rows(self) -> Dict[int, int]:
        """Sequence id -> its row among this step's sampled tokens (where the next step's inputs come from)."""
        if self._rows_of is None:
            samplers = self.rows.samplers
            self._rows_of = {samplers[i].seq.seq_id: k for k, i in enumerate(self.rows.normal)}
        return self._rows_of

    def fill_inputs(self, tokens: Optional[torch.Tensor]) -> None:
        """Put the previous step's sampled tokens (None: it failed) into this step's pending input ids, once;
        called on the worker only."""
        if self.fill is not None and not self.filled:
            self.fill.apply(self.inputs.input_ids, tokens)
        self.filled = True

    def fill_on_device(self, tokens: torch.Tensor) -> None:
        """Leave this step's pending input ids to the runner, from the previous step's tokens on the device (a
        runner that `fills_on_device`); called on the worker only."""
        if self.fill is not None and not self.filled:
            self.inputs.device_fill = DeviceFill(self.fill.positions, self.fill.rows, tokens)
        self.filled = True

    def deliver(self, result: StepResult, hold: bool) -> None:
        """The job's results: to the engine at once, or (`hold`: the next step is launched) kept until the next
        step's forward is on its way (`release`); worker side."""
        if hold:
            self._held = result
        else:
            self.results.set_result(result)

    def release(self) -> None:
        """Hand held results to the engine (once; nothing when none are held)."""
        held, self._held = self._held, None
        if held is not None:
            self.results.set_result(held)

    def sampled_tokens(self) -> Optional[torch.Tensor]:
        """Each sampled row's token ([rows] int64; on the device while they are pending), or None if the step
        failed. Waits for the step's job."""
        try:
            result = self.future.result()
        except BaseException:  # noqa: BLE001 - the step failed: its requests fail, its successor fills zeros
            return None
        pending = result.pending
        if pending is not None:
            return pending.tokens
        return None if result.batch is None else result.batch.first_tokens


_REPORTS_LAUNCH: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()


def reports_launch(runner) -> bool:
    """Whether the runner's `execute` takes `on_launched` (it then says when its forward is on its way); known
    per function, looked up once."""
    method = runner.execute
    key = getattr(method, "__func__", method)
    try:
        return _REPORTS_LAUNCH[key]
    except (KeyError, TypeError):
        pass
    try:
        known = "on_launched" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        known = False
    try:
        _REPORTS_LAUNCH[key] = known
    except TypeError:   # not weakly referable: asked again next time
        pass
    return known


class StepWorker:
    """Runs step jobs in launch order: on the process's compute thread (overlapped scheduling; compute_thread.py
    says why one thread for all torch work) or inline."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._last: Optional[concurrent.futures.Future] = None
        self._closed = False

    def submit(self, job: Callable[[], object]) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the engine's step worker is shut down")
        if self.threaded and not compute_thread.on_compute_thread():   # from there it would wait behind itself
            self._last = compute_thread.submit(job)
            return self._last
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as from the thread
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        """Take no more steps; wait for the last one submitted (the compute thread stays for other engines)."""
        self._closed = True
        last, self._last = self._last, None
        if last is not None:
            concurrent.futures.wait([last])
