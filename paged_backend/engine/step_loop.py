"""The step loop of `LLMEngine`: launch a step (schedule, advance the sequences, prepare inputs, hand it to the
worker), collect it (wait, apply its tokens, report), and with overlapped scheduling launch the next step before
collecting the current one. Failures of a step belong to its requests; a runner that cannot continue fails all."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from paged_backend import kernels
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.engine.input_builder import prepare_step
from paged_backend.engine.outputs import RequestOutput
from paged_backend.engine.step_pipeline import LaunchedStep, StepResult, reports_launch
from paged_backend.errors import EngineDeadError

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine

logger = logging.getLogger("paged_backend.engine.llm_engine")


class StepLoop:
    """`LLMEngine.step` and the halves it is made of (a part of `LLMEngine`, kept in its own module)."""

    # ---- one step ----------------------------------------------------------------------------
    def step(self: "LLMEngine") -> List[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that moved.

        With `async_scheduling` (the default) the next step is scheduled and launched before this one's results
        are processed, so that its forward runs while they are: a call returns the outputs of one step and leaves
        the next one running. A request that stops at a step may then have one more token computed in vain
        (never returned; its blocks are freed at once). A step with a request whose next step depends on more
        than its token (beam search, a first sample forking `best_of` sequences, penalties, logits processors,
        structured outputs, min-tokens masking) is processed before anything else is scheduled.

        A failure belongs to the request that caused it: an error while sampling or stopping one request
        fails that request only; a failed forward fails the step's requests and the others go on. Only a
        runner that cannot continue (`EngineDeadError`) fails everything, and the error is raised."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine cannot run: {self.errored}")
        outputs: List[RequestOutput] = []
        current, self._inflight = self._inflight, None
        if current is None:
            current = self._launch(None, outputs)
        successor = None
        if current is not None and self._worker.threaded and current.overlappable:
            successor = self._inflight = self._launch(current, outputs)
        if current is not None:
            outputs += self._collect(current, successor)
        else:
            self.scheduler.free_finished()
        if successor is not None and not self.scheduler.has_unfinished():
            self._drain()  # every row of it was computed in vain: wait for it, so nothing runs while idle
        return outputs

    def _launch(self: "LLMEngine", previous: Optional[LaunchedStep], outputs: List[RequestOutput]) -> Optional[LaunchedStep]:
        """Schedule a step and start it (after `previous`, whose sampled tokens some of its inputs are); the
        requests that failed to schedule go to `outputs`. None when there is nothing to run."""
        speculator = self.speculator
        if speculator is not None:
            speculator.policy.tick()
            if previous is None:  # every token is known: the running sequences may propose draft tokens
                speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if speculator is not None:
            speculator.settle(sched)
        lora_slots = self._assign_lora_slots(sched) if self.loras is not None else None
        for group in sched.failed:
            logger.error("request %r failed: %s", group.request_id, group.error)
            outputs.append(self._finalize(group))
        if not (sched.scheduled or sched.blocks_to_swap_in or sched.blocks_to_swap_out or sched.blocks_to_copy):
            return None
        used = self.block_manager.num_blocks - self.block_manager.get_num_free_blocks()
        self.counters.peak_used_blocks = max(self.counters.peak_used_blocks, used)
        inputs, fill = self._step_inputs(sched, previous, lora_slots)
        if inputs.num_tokens:
            self.counters.observe("iteration_tokens", inputs.num_tokens)
        rows = self.tokens.launch(sched)
        if speculator is not None and not rows.needs_processing and \
                speculator.wants_fresh_step(rows, self.scheduler.running):
            rows.needs_processing = True   # the next step is launched after this one is processed, to propose
        launched = LaunchedStep(sched, rows, list(self.scheduler.running), inputs, fill,
                                lora_slot_of=lora_slots[0] if lora_slots is not None else {})
        launched.future = self._worker.submit(lambda: self._execute(launched, previous))
        if previous is not None:   # its job, if still running, fills our inputs and holds its results for us
            previous.successor = launched
        return launched

    def _execute(self: "LLMEngine", launched: LaunchedStep, previous: Optional[LaunchedStep]) -> StepResult:
        """A step's worker job: its results (or its failure) for the engine; the previous step's held results
        are released by now, whatever happened."""
        try:
            return self._run_step(launched, previous)
        except BaseException as exc:
            launched.results.set_exception(exc)
            raise
        finally:
            if previous is not None:
                previous.release()

    def _run_step(self: "LLMEngine", launched: LaunchedStep, previous: Optional[LaunchedStep]) -> StepResult:
        """The device's part of a step (in the worker thread when overlapped): fill the inputs that the previous
        step sampled (unless that step's job did), run the forward (releasing the previous step's results once
        it is on its way), draw the sampled rows' tokens; if the next step is launched, fill its inputs and hold
        the results for it to release."""
        on_device = getattr(self.runner, "fills_on_device", False)
        if launched.fill is not None and not launched.filled:
            tokens = previous.sampled_tokens()
            if on_device and tokens is not None:   # on the device (a pending step's) or copied there
                launched.fill_on_device(tokens)
            else:
                launched.fill_inputs(tokens)
        logits = self._forward(launched.inputs, previous.release if previous is not None else None)
        if not launched.rows.normal:
            result = StepResult(logits)
        else:
            try:
                pending = self.tokens.sample_later(launched.rows, logits) if on_device else None
                result = StepResult(logits, pending=pending) if pending is not None else \
                    StepResult(logits, self.tokens.sample(launched.rows, logits))
            except Exception as exc:  # noqa: BLE001 - a batched sampling stage failed: the step's sampled rows fail
                result = StepResult(logits, None, exc)
        successor, launched.successor = launched.successor, None
        if successor is not None:   # on the worker; the successor's own job, after this one, finds it filled
            if result.pending is not None:   # from the device: nothing waits for the host before its forward
                successor.fill_on_device(result.pending.tokens)
            else:
                successor.fill_inputs(None if result.batch is None else result.batch.first_tokens)
        launched.deliver(result, hold=successor is not None)
        return result

    def _forward(self: "LLMEngine", inputs, on_launched: Optional[Callable[[], None]]):
        """The runner's forward; `on_launched` runs once it is on its way (by the runner, when it says when; else
        before it)."""
        if on_launched is None:
            return self.runner.execute(inputs)
        if not reports_launch(self.runner):
            on_launched()
            return self.runner.execute(inputs)
        return self.runner.execute(inputs, on_launched=on_launched)

    def _collect(self: "LLMEngine", launched: LaunchedStep, successor: Optional[LaunchedStep]) -> List[RequestOutput]:
        """Wait for a step, apply its tokens and report its requests."""
        try:
            result = launched.results.result()
        except EngineDeadError as exc:
            self._die(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the others go on
            outputs = self._fail_step(launched, exc, successor)
            self.scheduler.free_finished()
            return outputs
        result.settle()   # tokens the device sampled without the worker waiting: here they reach the host
        self.tokens.begin()
        self.tokens.process(launched.sched, launched.rows, result.logits, result.batch, result.sample_error)
        self.counters.num_steps += 1
        if successor is not None:  # a request preempted while its last token was being sampled ends off-queue
            for group in successor.sched.preempted:
                if group.is_finished():
                    self.scheduler.discard_finished(group)
        done = self.scheduler.free_finished()
        if self.speculator is not None and done:
            self.speculator.forget(done)
        return self._outputs_of(launched.sched.scheduled)

    def _step_inputs(self: "LLMEngine", sched: SchedulerOutput, previous: Optional[LaunchedStep], lora_slots):
        inputs, fill = prepare_step(sched.scheduled, self.block_manager.block_tables, self.config.cache.block_size,
                                    previous.sample_rows() if previous is not None else None)
        if self.device.type != "cpu":  # the kernels check CPU tables themselves; a device's are checked here, on
            # the host, before they are sent (so a hole is never read, and the device is not waited for)
            kernels.check_block_reads(inputs.block_tables, inputs.context_lens, inputs.query_start_loc,
                                      self.config.cache.block_size, self.block_manager.num_blocks, self.sliding_window)
        inputs.swap_out, inputs.swap_in, inputs.copies = (sched.blocks_to_swap_out, sched.blocks_to_swap_in,
                                                          sched.blocks_to_copy)
        if lora_slots is not None:
            inputs.lora = self.loras.step_inputs(sched.scheduled, *lora_slots)
        return inputs, fill

    def _assign_lora_slots(self: "LLMEngine", sched: SchedulerOutput) -> Tuple[Dict[int, int], Dict[int, object]]:
        """Device slots for the step's adapters (lora_int_id -> slot, slot -> weights to load); requests whose
        adapter cannot be loaded any more fail here and leave the step (into `sched.failed`)."""
        slot_of, loads, failed = self.loras.assign_slots(sched.scheduled)
        for group, why in failed.items():
            self.scheduler.fail(group, why)
        if failed:
            sched.scheduled = [item for item in sched.scheduled if item.group not in failed]
            sched.failed = sched.failed + list(failed)
        return slot_of, loads

    def _drain(self: "LLMEngine") -> None:
        """Wait for the step still running, if any, and drop its results (its requests have ended or will be
        failed by the caller); if it failed, the blocks it registered in the prefix cache are forgotten."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            try:
                launched.future.result()
            except BaseException:  # noqa: BLE001 - nobody waits for this step's requests any more
                self.block_manager.unregister(launched.rows.registered)

    # ---- failures ----------------------------------------------------------------------------
    def _fail_step(self: "LLMEngine", launched: LaunchedStep, exc: Exception,
                   successor: Optional[LaunchedStep] = None) -> List[RequestOutput]:
        """The forward failed: its requests (every one running when it was scheduled, and those swapped out by
        this step, whose blocks may be half moved) fail; waiting and earlier swapped requests are untouched.
        The blocks it registered in the prefix cache were never computed: they are forgotten, and so are the
        next step's (already launched, it may read them), whose requests that took one of them fail too."""
        error = f"the model step failed: {type(exc).__name__}: {exc}"
        swapped = set(map(id, self.scheduler.swapped))
        victims = [g for g in launched.running if not g.is_finished() and self.groups.get(g.request_id) is g]
        victims += [g for g in launched.sched.preempted if id(g) in swapped and self.groups.get(g.request_id) is g]
        poisoned = {block for _, block in launched.rows.registered}
        self.block_manager.unregister(launched.rows.registered)
        if self.loras is not None:
            self.loras.forget_slots()   # the runner may have filled some of the step's slots, or none
        if successor is not None:
            self.block_manager.unregister(successor.rows.registered)
            tables = self.block_manager.block_tables
            unloaded = launched.loaded_slots() - successor.loaded_slots()   # the successor counted on these
            chosen = set(map(id, victims))
            for item in successor.sched.scheduled:
                group = item.group
                if id(group) not in chosen and self.groups.get(group.request_id) is group and (
                        any(b in poisoned for s in group.seqs for b in tables.get(s.seq_id, ()))
                        or successor.lora_slot(group) in unloaded):
                    chosen.add(id(group))
                    victims.append(group)
        logger.error("step failed; failing the %d requests it ran", len(victims), exc_info=exc)
        for group in victims:
            self.scheduler.fail(group, error)
        return [self._finalize(group) for group in victims]

    def _die(self: "LLMEngine", exc: EngineDeadError) -> None:
        """The runner cannot continue: every request fails and the engine takes no more."""
        self.errored = exc
        self._drain()
        logger.error("the engine cannot continue: %s", exc)
        for group in list(self.groups.values()):
            self.scheduler.fail(group, f"the engine failed: {exc}")
            self._finalize(group)
