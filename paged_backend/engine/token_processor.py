"""After the forward: sampled tokens become sequences' tokens (forks for samples and beams, grammar states,
detokenization, stop conditions), each request's part guarded so that an error fails that request alone."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Dict, List

import torch

from paged_backend.engine.beam_forks import apply_beam_decisions
from paged_backend.sampling.beam_search import BeamSearchState
from paged_backend.core.block_manager import BlockManager
from paged_backend.engine.detokenizer import cut_at_stop, decode_new_text, find_stop_string
from paged_backend.engine.metrics import Counters
from paged_backend.sampling.sampler import SampleRequest, SampleResult, Sampler
from paged_backend.core.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_backend.structured.matcher import accept_grammar

logger = logging.getLogger("paged_backend.engine")


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The RNG of sample `index` of a seeded request: its own stream, so its tokens do not depend on when
    its siblings are sampled (they may be scheduled apart after a preemption)."""
    if index == 0:
        return torch.Generator(device="cpu").manual_seed(seed)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little"))


class TokenProcessor:
    """Applies one step's logits to the scheduled sequences: sampling, beam search, stops, bookkeeping."""

    def __init__(self, block_manager: BlockManager, sampler: Sampler, tokenizer,
                 counters: Counters, eos_token_ids: List[int], max_model_len: int) -> None:
        self.block_manager = block_manager
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._token_step: Dict[str, int] = {}  # request -> step of its last generated token

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept about it."""
        self._token_step.pop(request_id, None)

    # ---- failures ----------------------------------------------------------------------------
    def fail_group(self, group: SequenceGroup, error: str) -> None:
        """End one request with an error, logged once (the engine counts it as failed; the scheduler frees its
        blocks when the step's finished sequences are freed). A request that has already ended keeps its first
        error (a later failure of its other rows is not news)."""
        if group.error is not None or group.is_finished():
            return
        logger.error("request %r failed: %s", group.request_id, error)
        group.abort(error)

    def _guarded(self, group: SequenceGroup, what: str, action: Callable[[], None]) -> None:
        """Run one request's part of the step; an exception fails that request alone."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self.fail_group(group, f"{what} failed: {type(exc).__name__}: {exc}")

    # ---- one step ------------------------------------------------------------------------------
    def process(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        """Mark the step's chunks computed, then sample (or step the beam search of) every row that samples."""
        samplers: List[ScheduledSeq] = []
        now = time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            if item.samples:
                samplers.append(item)
            if item.num_tokens > 1 or seq.num_computed_tokens < seq.prompt_len:
                self.counters.num_prompt_tokens += item.num_tokens
            end = seq.num_computed_tokens + item.num_tokens
            self.counters.num_recomputed_tokens += max(0, min(end, seq.max_computed_tokens) - seq.num_computed_tokens)
            seq.max_computed_tokens = max(seq.max_computed_tokens, end)
            seq.num_computed_tokens = end
            self.block_manager.mark_computed(seq)
            self.block_manager.release_out_of_window(seq)
            if item.group.metrics.first_scheduled_time is None:
                item.group.metrics.first_scheduled_time = now
        rows = {id(item): i for i, item in enumerate(samplers)}
        normal = [item for item in samplers if not item.group.sampling_params.use_beam_search]
        if normal:  # every row in order (the usual case) needs no gathered copy of the logits
            self._sample(normal, logits if len(normal) == len(samplers) else
                         logits[[rows[id(item)] for item in normal]])
        beams = [item for item in samplers if item.group.sampling_params.use_beam_search]
        if beams:
            self._beam_search(beams, logits[[rows[id(item)] for item in beams]])

    def _sample_request(self, item: ScheduledSeq) -> SampleRequest:
        group = item.group
        params = group.sampling_params
        return SampleRequest(params, item.seq, 1 if group.branched else params.best_of, item.seq.generator,
                             group.stop_ids if params.min_tokens else ())

    def _sample(self, items: List[ScheduledSeq], logits: torch.Tensor) -> None:
        """Sample every row at once, then apply the results request by request: a request with a failed row
        fails and none of its rows' results is applied; the other requests' results are exactly what they would
        be without it (the sampler isolates rows; nothing is sampled twice)."""
        requests = [self._sample_request(item) for item in items]
        try:
            results = self.sampler.sample(logits, requests)
        except Exception as exc:  # noqa: BLE001 - a batched stage failed for no single row: the step's rows fail
            for item in items:
                self.fail_group(item.group, f"sampling failed: {type(exc).__name__}: {exc}")
            return
        for item, result in zip(items, results):
            if result.error is not None:
                self.fail_group(item.group, f"sampling failed: {result.error}")
        for item, result in zip(items, results):
            if item.group.error is None:
                self._guarded(item.group, "generating the next token",
                              lambda item=item, result=result: self._take_sample(item, result))

    def _take_sample(self, item: ScheduledSeq, result: SampleResult) -> None:
        group, seq = item.group, item.seq
        if not group.branched:
            group.branched = True
            seed = group.sampling_params.seed
            for j in range(1, len(result.token_ids)):
                child = seq.fork()
                child.generator = None if seed is None else sample_generator(seed, j)
                self.block_manager.fork(seq, child)
                group.seqs.append(child)
                self._append(group, child, result, j)
        self._append(group, seq, result, 0)

    def _append(self, group: SequenceGroup, seq: Sequence, result, j: int) -> None:
        params = group.sampling_params
        accept_grammar(seq, result.token_ids[j])  # first: a refused token is not appended
        seq.append_token(result.token_ids[j], result.logprobs[j])
        if result.top_logprobs is not None:
            seq.output_logprobs.append(result.top_logprobs[j])
        if result.scores is not None:
            seq.output_scores.append((result.logits, result.scores))
        self._note_token(group)
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens) if params.detokenize else ""
        self._check_stop(group, seq, new_text)

    def _note_token(self, group: SequenceGroup) -> None:
        now = time.monotonic()
        metrics = group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        elif self._token_step.get(group.request_id) != self.counters.num_steps:  # once per step and request
            self.counters.observe("time_per_output_token_seconds", now - metrics.last_token_time)
        self._token_step[group.request_id] = self.counters.num_steps
        metrics.last_token_time = now
        self.counters.num_generated_tokens += 1

    def _check_stop(self, group: SequenceGroup, seq: Sequence, new_text: str) -> None:
        params = group.sampling_params
        token = seq.token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_terminated:  # the structured output is complete
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
            if params.stop_strings and new_text:
                found = find_stop_string(seq.output_text, len(new_text), params.stop_strings)
                if found is not None:
                    stop = found[0]
                    seq.output_text = cut_at_stop(seq.output_text, len(new_text), stop,
                                                  params.include_stop_str_in_output)
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                    return
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
        elif len(seq) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    # ---- beam search -------------------------------------------------------------------------
    def _beam_search(self, items: List[ScheduledSeq], logits: torch.Tensor) -> None:
        requests = [SampleRequest(item.group.sampling_params, item.seq, 1, None,
                                  item.group.stop_ids) for item in items]
        try:
            log_probs, failures = self.sampler.beam_log_probs(logits, requests)
        except Exception as exc:  # noqa: BLE001 - a batched stage failed for no single row: the step's beams fail
            for item in items:
                self.fail_group(item.group, f"beam scoring failed: {type(exc).__name__}: {exc}")
            return
        for i, message in failures.items():
            self.fail_group(items[i].group, f"beam scoring failed: {message}")
        touched: Dict[str, SequenceGroup] = {}
        for i, item in enumerate(items):
            if item.group.is_finished():
                continue
            state: BeamSearchState = item.group.beam_state
            state.pending[item.seq.seq_id] = log_probs[i]
            if state.record_scores:
                state.pending_logits[item.seq.seq_id] = logits[i].to(torch.float32)
            touched[item.group.request_id] = item.group
        for group in touched.values():
            self._guarded(group, "the beam search step", lambda group=group: self._beam_advance(group))

    def _beam_advance(self, group: SequenceGroup) -> None:
        """Step the beam search once every live beam has its log-probs."""
        live = group.unfinished_seqs()
        state = group.beam_state
        if all(seq.seq_id in state.pending for seq in live):
            rows = torch.stack([state.pending.pop(seq.seq_id) for seq in live])
            if state.record_scores:
                state.record(rows, torch.stack([state.pending_logits.pop(seq.seq_id) for seq in live]))
            self._beam_step(group, live, rows)

    def _beam_step(self, group: SequenceGroup, live: List[Sequence], log_probs: torch.Tensor) -> None:
        state: BeamSearchState = group.beam_state
        decisions = state.step(log_probs, [seq.output_token_ids for seq in live], [seq.beam_indices for seq in live])
        group.branched = True
        for _ in decisions:
            self._note_token(group)
        if state.done:
            for seq in live:
                seq.status = SequenceStatus.FINISHED_STOPPED
            return
        group.seqs = apply_beam_decisions(live, decisions, self.block_manager)
